"""Registration, configuration and the version-guarded patches."""
import logging
import os
import subprocess
import sys

import pytest

from vllm_deepinfer import envs
from vllm_deepinfer.model import registration


def run_python(code: str, **env) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_register_is_idempotent_and_logs_its_choice_once(caplog):
    from vllm import ModelRegistry

    from vllm_deepinfer.plugins import register

    with caplog.at_level(logging.INFO, logger="vllm_deepinfer"):
        register()
        register()
    choices = [r for r in caplog.records if "DEEPINFER_MODEL_IMPL" in r.getMessage()]
    assert len(choices) <= 1  # at most once per process (an earlier test may have logged it)
    model_cls = ModelRegistry._try_load_model_cls(registration.ARCH)
    assert model_cls.__module__ == "vllm_deepinfer.model.deepseek_v41"


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins["deepinfer"] == "vllm_deepinfer.plugins:register"


@pytest.mark.parametrize("requested,expected", [("auto", "deepinfer"), ("deepinfer", "deepinfer"),
                                                ("vllm", "vllm")])
def test_model_impl_choice_on_cpu(requested, expected):
    assert registration.resolve_impl(requested) == expected


def test_model_impl_vllm_keeps_upstream_model():
    out = run_python(
        "from vllm import ModelRegistry\n"
        "from vllm_deepinfer.model.registration import register_deepseek_v41\n"
        "print(register_deepseek_v41())\n"
        "print(ModelRegistry.models['DeepseekV41ForCausalLM'].module_name)\n",
        DEEPINFER_MODEL_IMPL="vllm")
    assert out.split() == ["vllm", "vllm.models.deepseek_v41"]


def test_bad_setting_is_rejected_with_its_name():
    with pytest.raises(envs.ConfigError, match=r"DEEPINFER_MODEL_IMPL='gpu' is not valid; "
                                               r"use one of auto, deepinfer, vllm"):
        envs.load({"DEEPINFER_MODEL_IMPL": "gpu"})
    assert envs.load({"DEEPINFER_MODEL_IMPL": " Auto "}).model_impl == "auto"


def test_cli_version_patch_still_applies():
    """The patch is needed on this wheel, and `deepinfer --version` works where
    `vllm --version` dies."""
    from vllm_deepinfer.patches import cli_version

    assert cli_version.needed()
    out = subprocess.run([sys.executable, "-m", "vllm_deepinfer.serving.cli", "--version"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("+cpu")
    bare = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "--version"],
                          capture_output=True, text=True, timeout=300)
    assert bare.returncode != 0 and "PackageNotFoundError" in bare.stderr


def test_cpu_platform_patch_keeps_chunked_prefill_and_prefix_caching(tiny_checkpoint):
    out = run_python(
        "from vllm.engine.arg_utils import EngineArgs\n"
        f"c = EngineArgs(model={tiny_checkpoint!r}, max_num_batched_tokens=32, "
        "enable_chunked_prefill=True, enable_prefix_caching=True).create_engine_config()\n"
        "print(c.scheduler_config.enable_chunked_prefill, c.cache_config.enable_prefix_caching,"
        " c.scheduler_config.max_num_batched_tokens, c.cache_config.prefix_cache_retention_interval)\n")
    assert out.split()[-4:] == ["True", "True", "32", "None"]


def test_xgrammar_cache_patch_still_applies(tmp_path):
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    from vllm_deepinfer.patches import xgrammar_grammar_cache

    assert xgrammar_grammar_cache.apply(str(tmp_path))
    assert getattr(XgrammarBackend.__post_init__, "_deepinfer_grammar_cache", False)


def test_grammar_cache_dir_must_be_a_directory(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(envs.ConfigError, match="DEEPINFER_GRAMMAR_CACHE_DIR=.* is not a directory"):
        envs.load({"DEEPINFER_GRAMMAR_CACHE_DIR": str(not_a_dir)})
    assert envs.load({"DEEPINFER_GRAMMAR_CACHE_DIR": str(tmp_path)}).grammar_cache_dir == str(tmp_path)
