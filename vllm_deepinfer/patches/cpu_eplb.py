"""`--enable-eplb` on the CPU for the plugin's V4.1.

Why: `ParallelConfig` refuses EPLB on every platform but CUDA, ROCm and XPU, because
vLLM's MoE layers record expert load with a Triton kernel (a pass-through elsewhere) and
its asynchronous rearrangement runs on a device stream. The plugin's V4.1 records load
and maps replicas in torch (`vllm_deepinfer/eplb/load.py`), and vLLM's synchronous
rearrangement moves weights through its gloo communicator, so EPLB can run on the CPU.

How (on the CPU platform only):
- `ParallelConfig`'s validator runs with EPLB's platform check skipped and then checks
  what upstream checks next (expert parallelism on, more than one EP rank); asynchronous
  rearrangement is switched off (logged), as the CPU has no device stream.
- `CpuPlatform.check_and_update_config` refuses EPLB for every model the plugin does not
  serve, as before (their load is never recorded on the CPU).
- `EplbState.rearrange` times itself with `torch.Event(enable_timing=True)`, which the
  CPU backend does not support: on a CPU device it runs with a wall-clock event instead.

Upstream symbols: vllm.config.parallel.ParallelConfig._validate_parallel_config,
vllm.platforms.cpu.CpuPlatform.check_and_update_config,
vllm.distributed.eplb.eplb_state.EplbState.rearrange; written against vLLM 0.32.

Remove when: vLLM accepts EPLB on the CPU (`ParallelConfig(enable_eplb=True, ...)`
validates there: `apply()` then reports `not needed`)."""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.patches.base import (
    PatchUnavailable,
    installed,
    rebuild_config_schemas,
    source_of,
)

logger = init_logger(__name__)

UPSTREAM = (
    "vllm.config.parallel.ParallelConfig._validate_parallel_config, "
    "vllm.platforms.cpu.CpuPlatform.check_and_update_config, "
    "vllm.distributed.eplb.eplb_state.EplbState.rearrange"
)
_MARK = "_deepinfer_cpu_eplb"
_VALIDATOR = "_validate_parallel_config"
_REFUSAL = "Expert parallelism load balancing is only supported"


def _upstream():
    try:
        from vllm.config import parallel
        from vllm.platforms.cpu import CpuPlatform
    except ImportError as exc:
        raise PatchUnavailable(f"vLLM's parallel config cannot be imported ({exc})") from exc
    config = parallel.ParallelConfig
    if _VALIDATOR not in config.__dict__:
        raise PatchUnavailable(f"vllm.config.parallel.ParallelConfig.{_VALIDATOR} is missing")
    decorators = getattr(config, "__pydantic_decorators__", None)
    validator = getattr(decorators, "model_validators", {}).get(_VALIDATOR)
    if validator is None:
        raise PatchUnavailable(f"ParallelConfig.{_VALIDATOR} is no longer a model validator")
    upstream = getattr(validator.func, "upstream", validator.func)  # once wrapped here
    text = source_of(upstream, f"ParallelConfig.{_VALIDATOR}")
    if _REFUSAL not in text:
        raise PatchUnavailable(
            f"ParallelConfig.{_VALIDATOR} no longer refuses EPLB by "
            "platform (the check this patch skips on the CPU)"
        )
    raw = CpuPlatform.__dict__.get("check_and_update_config")
    if not isinstance(raw, classmethod):
        raise PatchUnavailable("vllm.platforms.cpu.CpuPlatform.check_and_update_config is missing")
    from vllm.distributed.eplb.eplb_state import EplbState

    rearrange = EplbState.__dict__.get("rearrange")
    if not callable(rearrange):
        raise PatchUnavailable("vllm.distributed.eplb.eplb_state.EplbState.rearrange is missing")
    if "torch.Event(" not in source_of(rearrange, "EplbState.rearrange"):
        raise PatchUnavailable(
            "EplbState.rearrange no longer times itself with torch.Event "
            "(what this patch answers on the CPU)"
        )
    return config, decorators, validator, CpuPlatform, raw, EplbState


def _eplb_checks(config) -> None:
    """What upstream checks of EPLB after the platform: expert parallelism on, and more
    than one rank in the EP group."""
    if not config.enable_expert_parallel:
        raise ValueError("EPLB needs expert parallelism: add --enable-expert-parallel")
    ranks = (
        config.tensor_parallel_size
        * config.prefill_context_parallel_size
        * config.data_parallel_size
    )
    if ranks <= 1:
        raise ValueError(
            "EPLB needs more than one expert-parallel rank: set "
            "--tensor-parallel-size or --data-parallel-size above 1"
        )


def _wrap_validator(original):
    # Not functools.wraps: pydantic follows `__wrapped__` back to the function it wraps
    # when it builds the schema of a class that embeds ParallelConfig.
    def validate(self):
        if not self.enable_eplb:
            return original(self)
        _eplb_checks(self)
        eplb = self.eplb_config
        if eplb.use_async:
            logger.info(
                "EPLB rearranges experts synchronously on the CPU "
                "(asynchronous rearrangement needs a device stream)"
            )
            eplb.use_async = False
        # Upstream's remaining checks, without the platform refusal: EPLB off meanwhile
        # (its redundant experts too, which upstream refuses without EPLB).
        redundant = eplb.num_redundant_experts
        self.enable_eplb, eplb.num_redundant_experts = False, 0
        try:
            return original(self)
        finally:
            self.enable_eplb, eplb.num_redundant_experts = True, redundant

    validate.__name__ = validate.__qualname__ = original.__name__
    validate.__doc__ = original.__doc__
    validate.upstream = original  # what detection reads (`installed` stops at the mark)
    setattr(validate, _MARK, True)
    return validate


def _wrap_platform_check(original, serves_model):
    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config) -> None:
        model_config = vllm_config.model_config
        if vllm_config.parallel_config.enable_eplb and (
            model_config is None or not serves_model(model_config)
        ):
            raise ValueError(
                "EPLB runs on the CPU for vllm-deepinfer's DeepSeek V4.1 only "
                "(other models' expert load is not recorded on the CPU)"
            )
        return original(cls, vllm_config)

    setattr(check_and_update_config, _MARK, True)
    return check_and_update_config


class WallClockEvent:
    """`torch.Event(enable_timing=True)` as EplbState.rearrange uses it, on the CPU."""

    def __init__(self, *args, **kwargs):
        self.at = None

    def record(self, *args) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: WallClockEvent) -> float:
        return (end.at - self.at) * 1000.0  # milliseconds, as torch reports


def _wrap_rearrange(original):
    @functools.wraps(original)
    def rearrange(self, *args, **kwargs):
        if self.device.type != "cpu":
            return original(self, *args, **kwargs)
        event, torch.Event = torch.Event, WallClockEvent
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Event = event

    setattr(rearrange, _MARK, True)
    return rearrange


def apply(serves_model) -> bool:
    """Idempotent. True when installed; False off the CPU or where vLLM accepts EPLB on
    the CPU already. `serves_model(model_config)`: whether the plugin's V4.1 serves it."""
    from vllm.platforms import current_platform

    config, decorators, validator, cpu_platform, raw, eplb_state = _upstream()
    if installed(validator.func, _MARK):
        return True
    if (
        not current_platform.is_cpu()
        or current_platform.is_cuda_alike()
        or current_platform.is_xpu()
    ):
        return False
    wrapped = _wrap_validator(validator.func)
    # Pydantic reads a validator from the class's decorator record (its own schema) and
    # from the class attribute (schemas that embed the class): both get the wrapper.
    decorators.model_validators[_VALIDATOR] = dataclasses.replace(validator, func=wrapped)
    setattr(config, _VALIDATOR, wrapped)
    rebuild_config_schemas(config)
    cpu_platform.check_and_update_config = classmethod(
        _wrap_platform_check(raw.__func__, serves_model)
    )
    eplb_state.rearrange = _wrap_rearrange(eplb_state.rearrange)
    return True
