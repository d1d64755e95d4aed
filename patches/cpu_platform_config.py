"""vLLM's CPU platform switches chunked prefill and prefix caching off for every MLA model
(its own CPU MLA kernels cannot serve them without AMX) and raises the token budget to
the whole context. The plugin's V4.1 keeps its caches and attention in its own hands and
supports both, so for it the user's settings are put back.

V4.1's caches are sliding-window groups; with vLLM's default retention (0) only the
latest boundary of each request stays reusable, so a prompt sharing just a prefix with an
earlier one gets no hit. For V4.1 the default becomes dense retention (None)."""
from __future__ import annotations

SUPPORTED_VLLM = ("0.32.",)
_MARK = "_deepinfer_v41_cpu_config"


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def apply(serves_model) -> bool:
    """Wraps CpuPlatform.check_and_update_config; `serves_model(model_config)` says whether
    the plugin's model will run. Idempotent; returns whether the wrapper is installed."""
    from vllm.platforms.cpu import CpuPlatform

    if getattr(CpuPlatform.check_and_update_config, _MARK, False):
        return True
    if not _vllm_version().startswith(SUPPORTED_VLLM):
        raise RuntimeError(f"patch cpu_platform_config was written for vLLM {SUPPORTED_VLLM}, "
                           f"found {_vllm_version()}; re-check vllm/platforms/cpu.py")
    original = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
        model_config = vllm_config.model_config
        keep = model_config is not None and serves_model(model_config)
        chosen = (scheduler.enable_chunked_prefill, cache.enable_prefix_caching,
                  scheduler.max_num_batched_tokens)
        original(cls, vllm_config)
        if keep:
            (scheduler.enable_chunked_prefill, cache.enable_prefix_caching,
             scheduler.max_num_batched_tokens) = chosen
            if cache.prefix_cache_retention_interval == 0:
                cache.prefix_cache_retention_interval = None

    setattr(check_and_update_config, _MARK, True)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    return True
