"""The user's settings: DEEPINFER_CONTEXT_CACHE_* parsed and checked, and
`--context-cache-dir` expanded to the connector configuration."""

import json

import pytest

from vllm_deepinfer import envs
from vllm_deepinfer.context_cache.config import connector_config
from vllm_deepinfer.serving.cli import expand_context_cache_flag

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "value, seconds",
    [("7d", 7 * 86400), ("12h", 43200), ("90", 90), ("1.5m", 90), (" 3D ", 3 * 86400)],
)
def test_ttl_accepts_units(value, seconds):
    assert envs.load({"DEEPINFER_CONTEXT_CACHE_TTL": value}).context_cache_ttl_seconds == seconds


@pytest.mark.parametrize("value", ["0", "-1d", "3w", "", "d"])
def test_bad_ttl_refused_by_name(value):
    with pytest.raises(envs.ConfigError, match="DEEPINFER_CONTEXT_CACHE_TTL"):
        envs.load({"DEEPINFER_CONTEXT_CACHE_TTL": value})


@pytest.mark.parametrize(
    "value, size", [("20G", 20 * 2**30), ("512MiB", 512 * 2**20), ("4096", 4096), ("1.5k", 1536)]
)
def test_max_bytes_accepts_units(value, size):
    assert envs.load({"DEEPINFER_CONTEXT_CACHE_MAX_BYTES": value}).context_cache_max_bytes == size


@pytest.mark.parametrize("value", ["0", "lots", "-5G"])
def test_bad_max_bytes_refused_by_name(value):
    with pytest.raises(envs.ConfigError, match="DEEPINFER_CONTEXT_CACHE_MAX_BYTES"):
        envs.load({"DEEPINFER_CONTEXT_CACHE_MAX_BYTES": value})


def test_defaults_off_three_days(tmp_path):
    settings = envs.load({})
    assert settings.context_cache_dir is None
    assert settings.context_cache_ttl_seconds == 3 * 86400
    assert settings.context_cache_max_bytes is None
    file = tmp_path / "f"
    file.write_text("")
    with pytest.raises(envs.ConfigError, match="not a directory"):
        envs.load({"DEEPINFER_CONTEXT_CACHE_DIR": str(file)})


def test_connector_config_is_deepseeks_defaults(tmp_path):
    settings = envs.load(
        {
            "DEEPINFER_CONTEXT_CACHE_DIR": str(tmp_path),
            "DEEPINFER_CONTEXT_CACHE_TTL": "7d",
            "DEEPINFER_CONTEXT_CACHE_MAX_BYTES": "1G",
            "DEEPINFER_PD_KV_WAIT_SECONDS": "3",
        }
    )
    config = connector_config(settings)
    extra = config["kv_connector_extra_config"]
    # vLLM's OffloadingConnector with the prefill's announcement for P/D (handoff.py)
    from vllm_deepinfer.context_cache import connector

    assert config["kv_connector"] == "DeepInferOffloadingConnector"
    assert config["kv_connector_module_path"] == connector.__name__
    assert config["kv_load_failure_policy"] == "recompute"
    assert extra["offload_prompt_only"] is False  # answers cached too
    [tier] = extra["secondary_tiers"]
    assert tier["root_dir"] == str(tmp_path) and tier["ttl_seconds"] == 7 * 86400
    assert tier["max_bytes"] == 2**30 and tier["pd_wait_seconds"] == 3
    from vllm.config import KVTransferConfig

    KVTransferConfig(**config)  # vLLM accepts it


def test_cli_flag_expands_to_kv_transfer_config(tmp_path, monkeypatch):
    # The flag sets the variable for the server's processes; put back afterwards.
    monkeypatch.setenv("DEEPINFER_CONTEXT_CACHE_DIR", "unused")
    argv = ["deepinfer", "serve", "m", "--context-cache-dir", str(tmp_path), "--port", "1"]
    expanded = expand_context_cache_flag(argv)
    assert expanded[:3] == ["deepinfer", "serve", "m"] and "--context-cache-dir" not in expanded
    assert expanded[3:5] == ["--port", "1"] and expanded[5] == "--kv-transfer-config"
    tier = json.loads(expanded[6])["kv_connector_extra_config"]["secondary_tiers"][0]
    assert tier["root_dir"] == str(tmp_path)
    assert expand_context_cache_flag(["deepinfer", "serve", "m"]) == ["deepinfer", "serve", "m"]
    with pytest.raises(SystemExit, match="give one"):
        expand_context_cache_flag([*argv, "--kv-transfer-config", "{}"])
    with pytest.raises(SystemExit, match="needs a directory"):
        expand_context_cache_flag(["deepinfer", "serve", "m", "--context-cache-dir"])
