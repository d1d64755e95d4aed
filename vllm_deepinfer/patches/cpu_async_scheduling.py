"""Asynchronous scheduling for the plugin's V4.1 on the CPU (DEEPINFER_ASYNC_SCHEDULING).

Why: with async scheduling the engine core schedules step N+1 while the worker still runs
step N, so scheduling, output processing and the engine's IPC overlap the forward pass.
`VllmConfig.__post_init__` decides it (the user's `--[no-]async-scheduling`, then vLLM's
own compatibility checks: speculative-decoding method, executor, pooling, pipeline
parallelism), and only then calls the platform's `check_and_update_config`, which on the
CPU sets `async_scheduling = False` for every model, whatever was asked. No hook runs
after the platform's, so the wrapper around it puts vLLM's own decision back. A platform
plugin could override the method instead, but it would replace the CPU platform for every
model and process; this wrapper changes one field, of V4.1 configs only.

The decision (`decide`), for V4.1 configs only: on when DEEPINFER_ASYNC_SCHEDULING is on,
vLLM had decided on before the CPU platform's override (so an explicit
`--no-async-scheduling` / `async_scheduling=False` is respected, as is every case vLLM
itself runs without it), there is no speculative decoding (vLLM allows some methods with
async scheduling, none of them verified with it on the CPU), and the executor vLLM will
start supports it (`Executor.supports_async_scheduling()`: the multiprocess executor that
`vllm serve` and `LLM` use on the CPU does; so does the in-process one, which gains little
as it runs each step in the engine's own thread). One line per V4.1 config logs the
outcome and why. vLLM's value after `__post_init__` cannot tell an explicit
`--no-async-scheduling` from vLLM's own checks; vLLM logs the latter itself.

With two steps in flight, vLLM sizes sliding-window caches for two token budgets instead
of one, so a request of the full model length needs a few more KV blocks.

Other models keep the CPU platform's choice: the plugin verified async scheduling only for
its own model, and the benchmarks compare against vLLM's Llama as stock vLLM runs it.

Upstream symbol: vllm.platforms.cpu.CpuPlatform.check_and_update_config (the override);
written against vLLM 0.32. Remove when the CPU platform stops forcing async scheduling off
(`apply()` then returns False: not needed; vLLM's own setting applies and
DEEPINFER_ASYNC_SCHEDULING has no effect).
"""

from __future__ import annotations

import dataclasses
import re

from vllm_deepinfer import envs
from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.patches.base import PatchUnavailable, installed, source_of, upstream_classmethod

logger = init_logger(__name__)

UPSTREAM = "vllm.platforms.cpu.CpuPlatform.check_and_update_config"
_MARK = "_deepinfer_cpu_async_scheduling"
_FORCES_OFF = re.compile(r"\.async_scheduling\s*=\s*False")


def decide(
    requested: bool, vllm_choice: bool, speculative_method: str | None, executor
) -> tuple[bool, str]:
    """(async scheduling on?, why) for a V4.1 config. `vllm_choice`: vLLM's decision before
    the CPU platform's override; `executor`: the executor class vLLM will start."""
    if not requested:
        return False, "DEEPINFER_ASYNC_SCHEDULING=off"
    if not vllm_choice:
        return False, (
            "vLLM had decided off before the CPU platform's override: "
            "--no-async-scheduling / async_scheduling=False, or a configuration "
            "vLLM runs without it (vLLM logs which)"
        )
    if speculative_method is not None:
        return False, (
            f"speculative decoding ({speculative_method}) is not verified with "
            "async scheduling on the CPU"
        )
    if not executor.supports_async_scheduling():
        return False, f"the {executor.__name__} executor does not support it"
    return True, (
        f"DEEPINFER_ASYNC_SCHEDULING=on, {executor.__name__}; the CPU platform's "
        "override to off is undone"
    )


def check_upstream():
    """Returns (CpuPlatform, upstream's classmethod, Executor); raises PatchUnavailable when
    what the wrapper relies on has changed. Returns None for the classmethod when the CPU
    platform no longer forces async scheduling off (nothing to undo)."""
    try:
        from vllm.config import SchedulerConfig
        from vllm.platforms.cpu import CpuPlatform
        from vllm.v1.executor.abstract import Executor
    except ImportError as exc:
        raise PatchUnavailable(
            f"the CPU platform or vLLM's executors cannot be imported ({exc})"
        ) from exc
    raw = upstream_classmethod(CpuPlatform, "check_and_update_config", UPSTREAM, ("vllm_config",))
    for name in ("get_class", "supports_async_scheduling"):
        if not callable(getattr(Executor, name, None)):
            raise PatchUnavailable(f"vllm.v1.executor.abstract.Executor.{name} is missing")
    if "async_scheduling" not in {f.name for f in dataclasses.fields(SchedulerConfig)}:
        raise PatchUnavailable("vllm.config.SchedulerConfig has no field async_scheduling")
    if not _FORCES_OFF.search(source_of(raw.__func__, UPSTREAM)):
        return CpuPlatform, None, Executor
    return CpuPlatform, raw, Executor


def apply(serves_model) -> bool:
    """Wraps CpuPlatform.check_and_update_config; `serves_model(model_config)` says whether
    the plugin's V4.1 will run. Idempotent. True once the wrapper is installed, False when
    the CPU platform no longer forces async scheduling off."""
    CpuPlatform, raw, Executor = check_upstream()
    if raw is None:
        return False
    if installed(raw.__func__, _MARK):
        return True
    original = raw.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        scheduler = vllm_config.scheduler_config
        vllm_choice = bool(scheduler.async_scheduling)
        original(cls, vllm_config)
        model_config = vllm_config.model_config
        if model_config is None or not serves_model(model_config):
            return
        speculative = vllm_config.speculative_config
        on, why = decide(
            envs.load().async_scheduling,
            vllm_choice,
            speculative.method if speculative is not None else None,
            Executor.get_class(vllm_config),
        )
        scheduler.async_scheduling = on
        logger.info(
            "Async scheduling %s for %s: %s", "on" if on else "off", model_config.architecture, why
        )

    setattr(check_and_update_config, _MARK, True)
    check_and_update_config.__wrapped__ = original  # detection reads upstream through it
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    return True
