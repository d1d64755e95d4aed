"""vLLM's CPU platform switches chunked prefill and prefix caching off for every MLA model
(its own CPU MLA kernels cannot serve them without AMX) and raises the token budget to
the whole context. The plugin's V4.1 keeps its caches and attention in its own hands and
supports both, so for it the user's settings are put back.

V4.1's caches are sliding-window groups; with vLLM's default retention (0) only the
latest boundary of each request stays reusable, so a prompt sharing just a prefix with an
earlier one gets no hit. For V4.1 the default becomes dense retention (None).

The platform also picks vLLM's CPU worker when the user left `worker_cls` at `auto`; for
V4.1 it becomes the plugin's subclass, which tells the model where bounded replays start
(vLLM's V1 runner passes replay starts to no model). With DSpark speculative decoding the
plugin's scheduler is chosen when `scheduler_cls` is unset; with EPLB, the one carrying the
workers' `moe_lb` into the step stats (eplb/metrics.py). DEEPINFER_CONTEXT_CACHE_DIR
becomes the context cache's connector configuration (context_cache/config.py) when the
user gave no `--kv-transfer-config`.

Relies on: `CpuPlatform.check_and_update_config(cls, vllm_config)` being a classmethod
that switches `enable_chunked_prefill` / `enable_prefix_caching` off for MLA models, and
on the config fields it puts back. Required for V4.1 on the CPU. Can go when vLLM lets a
model declare that it supports chunked prefill and prefix caching on the CPU (or stops
forcing them off for MLA models there) and V4.1's retention default moves into the model."""

from __future__ import annotations

import dataclasses
import re

from vllm_deepinfer.context_cache import config as context_cache
from vllm_deepinfer.model.deepseek_v41.registration import uses_dspark_stages
from vllm_deepinfer.patches.base import PatchUnavailable, installed, source_of, upstream_classmethod
from vllm_deepinfer.vllm_support import has_model_runner_v1

UPSTREAM = "vllm.platforms.cpu.CpuPlatform.check_and_update_config"
WORKER = "vllm_deepinfer.worker.cpu_worker.DeepInferCPUWorker"
DSPARK_SCHEDULER = "vllm_deepinfer.spec_decode.dspark.scheduler.DSparkScheduler"
MOE_BALANCE_SCHEDULER = "vllm_deepinfer.eplb.metrics.MoeBalanceScheduler"
_MARK = "_deepinfer_v41_cpu_config"
# What upstream must still do for this patch to have something to correct.
_BEHAVIOUR = (
    (re.compile(r"\buse_mla\b"), "decides by the model's use of MLA"),
    (re.compile(r"\.enable_chunked_prefill\s*=\s*False"), "switches chunked prefill off"),
    (re.compile(r"\.enable_prefix_caching\s*=\s*False"), "switches prefix caching off"),
)
# The fields the wrapper saves and puts back.
_FIELDS = {
    "SchedulerConfig": ("enable_chunked_prefill", "max_num_batched_tokens"),
    "CacheConfig": ("enable_prefix_caching", "prefix_cache_retention_interval"),
    "ParallelConfig": ("worker_cls",),
}


def check_upstream():
    """Returns upstream's classmethod; raises PatchUnavailable when the symbol, its
    signature, the behaviour corrected or the config fields put back have changed."""
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError as exc:
        raise PatchUnavailable(
            f"vllm.platforms.cpu.CpuPlatform cannot be imported ({exc})"
        ) from exc
    raw = upstream_classmethod(CpuPlatform, "check_and_update_config", UPSTREAM, ("vllm_config",))
    source = source_of(raw.__func__, UPSTREAM)
    for pattern, what in _BEHAVIOUR:
        if not pattern.search(source):
            raise PatchUnavailable(
                f"{UPSTREAM} no longer {what} (its source lacks "
                f"{pattern.pattern!r}); re-check what V4.1 needs corrected"
            )
    import vllm.config as vllm_config

    for cls_name, names in _FIELDS.items():
        cls = getattr(vllm_config, cls_name, None)
        fields = (
            {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        )
        missing = [name for name in names if name not in fields]
        if missing:
            raise PatchUnavailable(f"vllm.config.{cls_name} has no field {', '.join(missing)}")
    return CpuPlatform, raw


def apply(serves_model) -> bool:
    """Wraps CpuPlatform.check_and_update_config; `serves_model(model_config)` says whether
    the plugin's model will run. Idempotent; returns True once the wrapper is installed."""
    CpuPlatform, raw = check_upstream()
    if installed(raw.__func__, _MARK):
        return True
    original = raw.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
        model_config = vllm_config.model_config
        keep = model_config is not None and serves_model(model_config)
        chosen = (
            scheduler.enable_chunked_prefill,
            cache.enable_prefix_caching,
            scheduler.max_num_batched_tokens,
        )
        parallel = vllm_config.parallel_config
        automatic_worker = parallel.worker_cls == "auto"
        original(cls, vllm_config)
        if keep:
            (
                scheduler.enable_chunked_prefill,
                cache.enable_prefix_caching,
                scheduler.max_num_batched_tokens,
            ) = chosen
            if cache.prefix_cache_retention_interval == 0:
                cache.prefix_cache_retention_interval = None
            if automatic_worker and has_model_runner_v1():  # the worker hooks that runner
                parallel.worker_cls = WORKER
            context_cache.apply(vllm_config)  # DEEPINFER_CONTEXT_CACHE_DIR
            if scheduler.scheduler_cls is None:
                if uses_dspark_stages(vllm_config):
                    # DSpark's scheduler folds the proposer's counts into the step stats.
                    scheduler.scheduler_cls = DSPARK_SCHEDULER
                elif parallel.enable_eplb:  # the workers' moe_lb into the step stats
                    scheduler.scheduler_cls = MOE_BALANCE_SCHEDULER

    setattr(check_and_update_config, _MARK, True)
    check_and_update_config.__wrapped__ = original  # detection reads upstream through it
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    return True
