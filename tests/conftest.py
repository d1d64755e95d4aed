"""Session fixtures: the embedded checkpoints are built once per test session, and vLLM
engines are shared by the tests of a module (each start costs ~20 s)."""
import os
import tempfile

# Engines run in this process: faster to start, and the tests can read their results
# directly. The serving tests start real multi-process servers instead.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Compiled grammars go to a cache of this test session only.
os.environ.setdefault("DEEPINFER_GRAMMAR_CACHE_DIR", tempfile.mkdtemp(prefix="grammars-"))

import gc  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import requests  # noqa: E402

from vllm_deepinfer.checkpoint.tiny import write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    return write_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-v41"))


@pytest.fixture(scope="session")
def quantized_checkpoint(tmp_path_factory) -> str:
    return write_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-v41-mx"), quantized=True)


def make_llm(model: str, **overrides):
    from vllm import LLM

    options = dict(model=model, dtype="float32", max_model_len=512, enforce_eager=True,
                   block_size=16, enable_prefix_caching=True, enable_chunked_prefill=True,
                   max_num_batched_tokens=64, max_num_seqs=8, seed=0)
    options.update(overrides)
    return LLM(**options)


def close_llm(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


SERVED_NAME = "tiny-v41"
SERVER_STARTUP_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def api_server(tiny_checkpoint, tmp_path_factory):
    """`deepinfer serve` with both plugin entry points on (VLLM_PLUGINS=deepinfer), as a
    user would start it; shared by the serving tests and stopped by its PID."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_PLUGINS="deepinfer")
    command = [sys.executable, "-m", "vllm_deepinfer.serving.cli", "serve", tiny_checkpoint,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", "2048", "--enforce-eager", "--served-model-name", SERVED_NAME,
               "--reasoning-parser", "deepseek_v41"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_STARTUP_TIMEOUT_S
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"server exited with {process.returncode}:\n"
                            f"{log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {SERVER_STARTUP_TIMEOUT_S}s:\n"
                            f"{log_path.read_text()[-4000:]}")
            time.sleep(1)
        yield base
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
