"""Each patch still does its job on the installed vLLM (moved from tests/test_plugin.py)."""

import subprocess
import sys

import pytest

from helpers import run_python


@pytest.mark.engine
def test_cli_version_patch_still_applies():
    """The patch is needed on this wheel, and `deepinfer --version` works where
    `vllm --version` dies."""
    from vllm_deepinfer.patches import cli_version

    assert cli_version.needed()
    out = subprocess.run(
        [sys.executable, "-m", "vllm_deepinfer.serving.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("+cpu")
    bare = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "--version"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bare.returncode != 0 and "PackageNotFoundError" in bare.stderr


@pytest.mark.engine
def test_cpu_platform_patch_keeps_chunked_prefill_and_prefix_caching(tiny_checkpoint):
    """And Inductor keeps its own vector width for V4.1's generated loops."""
    out = run_python(
        "from vllm.engine.arg_utils import EngineArgs\n"
        f"c = EngineArgs(model={tiny_checkpoint!r}, max_num_batched_tokens=32, "
        "enable_chunked_prefill=True, enable_prefix_caching=True).create_engine_config()\n"
        "print(c.scheduler_config.enable_chunked_prefill, c.cache_config.enable_prefix_caching,"
        " c.scheduler_config.max_num_batched_tokens, c.cache_config.prefix_cache_retention_interval,"
        " c.parallel_config.worker_cls, 'cpp.simdlen' in c.compilation_config.inductor_compile_config)\n"
    )
    assert out.stdout.split()[-6:] == [
        "True",
        "True",
        "32",
        "None",
        "vllm_deepinfer.worker.cpu_worker.DeepInferCPUWorker",
        "False",
    ]


@pytest.mark.unit
def test_xgrammar_cache_patch_still_applies(tmp_path, monkeypatch):
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    from vllm_deepinfer.patches import xgrammar_grammar_cache

    # Put back whatever this process had once the test is done (tmp_path goes away).
    monkeypatch.setattr(XgrammarBackend, "__post_init__", XgrammarBackend.__post_init__)
    assert xgrammar_grammar_cache.apply(str(tmp_path))
    assert getattr(XgrammarBackend.__post_init__, "_deepinfer_grammar_cache", False)
