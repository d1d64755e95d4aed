"""`deepinfer serve --context-cache-dir DIR` / DEEPINFER_CONTEXT_CACHE_DIR expanded to the
OffloadingConnector configuration DeepSeek's context caching uses: global KV only (vLLM
offloads the prefix-cacheable groups), earlier answers cached as well as prompts, a
failed load recomputed, blocks kept on disk for the TTL; the same configuration serves
both halves of P/D disaggregation (`handoff.py`). `--kv-transfer-config` given by the
user is left alone.
"""

from __future__ import annotations

from vllm_deepinfer import envs
from vllm_deepinfer.context_cache import connector, disk_tier, spec
from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)

DISK_TIER_TYPE = "PersistentDiskTier"
HOST_TIER_BYTES = 256 * 2**20
"""The host-memory tier in front of the disk: blocks are staged there on their way to and
from disk, and recent ones are served from it."""
IO_THREADS = 4


def connector_config(settings: envs.DeepInferSettings) -> dict:
    """The `--kv-transfer-config` the settings stand for."""
    tier = {
        "type": DISK_TIER_TYPE,
        "module_path": disk_tier.__name__,
        "root_dir": settings.context_cache_dir,
        "ttl_seconds": settings.context_cache_ttl_seconds,
        "max_disk_fraction": disk_tier.DEFAULT_MAX_DISK_FRACTION,
        "pd_wait_seconds": settings.pd_kv_wait_seconds,
        "n_read_threads": IO_THREADS,
        "n_write_threads": IO_THREADS,
    }
    if settings.context_cache_max_bytes:
        tier["max_bytes"] = settings.context_cache_max_bytes
    return {
        "kv_connector": connector.CONNECTOR_NAME,
        "kv_connector_module_path": connector.CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": spec.SPEC_NAME,
            "spec_module_path": spec.SPEC_MODULE,
            "cpu_bytes_to_use": HOST_TIER_BYTES,
            "offload_prompt_only": False,
            "secondary_tiers": [tier],
        },
    }


def apply(vllm_config) -> None:
    """Sets the connector from DEEPINFER_CONTEXT_CACHE_DIR when the user configured none."""
    settings = envs.load()
    if settings.context_cache_dir is None or vllm_config.kv_transfer_config is not None:
        return
    from vllm_deepinfer.model.deepseek_v41.model import is_encoder_only

    if is_encoder_only(vllm_config):
        logger.info("Encoder-only instance: no context cache (it keeps no KV)")
        return
    from vllm.config import KVTransferConfig

    vllm_config.kv_transfer_config = KVTransferConfig(**connector_config(settings))
