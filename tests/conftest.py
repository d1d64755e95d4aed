"""Session fixtures: the embedded checkpoints are built once per test session, and vLLM
engines are shared by the tests of a module (each start costs ~20 s)."""
import os

# Engines run in this process: faster to start, and the tests can read their results
# directly. The serving tests start real multi-process servers instead.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import gc  # noqa: E402

import pytest  # noqa: E402

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
