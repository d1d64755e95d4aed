"""`deepinfer serve` (vLLM's own OpenAI server with the plugin) on 127.0.0.1.

One real multi-process server for the module, started like a user would and stopped by
its PID; its greedy completions must equal the reference's."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests
import torch

from vllm_deepinfer.model.reference import ReferenceV41

STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    command = [sys.executable, "-m", "vllm_deepinfer.serving.cli", "serve", tiny_checkpoint,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", "512", "--enforce-eager", "--served-model-name", "tiny-v41"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
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
                pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n"
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


def complete(base: str, prompt, **extra) -> requests.Response:
    body = {"model": "tiny-v41", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, **extra}
    return requests.post(f"{base}/v1/completions", json=body, timeout=120)


def test_completions_equal_the_reference(server, tiny_checkpoint):
    prompt = torch.randint(3, 800, (70,), generator=torch.Generator().manual_seed(11)).tolist()
    response = complete(server, prompt, logprobs=1, return_tokens_as_token_ids=True)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    reference = ReferenceV41(tiny_checkpoint)
    logits = reference.logits(prompt + tokens[:-1])
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == tokens
    usage = response.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (70, 8)


def test_text_prompt_and_bad_request_then_keeps_serving(server):
    ok = complete(server, "The quick brown fox")
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) > 0
    too_long = complete(server, "The quick brown fox", max_tokens=100000)
    assert too_long.status_code == 400
    assert "max_tokens" in too_long.text or "context" in too_long.text
    again = complete(server, "The quick brown fox")
    assert again.status_code == 200
    assert again.json()["choices"][0]["text"] == ok.json()["choices"][0]["text"]
