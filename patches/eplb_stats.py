"""`moe_lb` in the stats the engine core sends the front end.

The engine core's outputs are decoded by type (msgspec), so an attribute vLLM's
`SchedulerStats` does not declare is dropped on the way to the front end's stat loggers.
The patch declares one more field, `deepinfer_moe_lb: list[float] | None = None`
([overall, per MoE layer...], set by the plugin's scheduler on the steps vLLM's EPLB logs
balancedness: vllm_deepinfer/eplb/metrics.py), in every process before any encoder or
decoder is built; stats without it encode and decode as before.

Upstream symbol: vllm.v1.metrics.stats.SchedulerStats (a dataclass). Remove when vLLM's
scheduler stats carry EPLB load balance (or let a plugin add stats of its own).
"""
from __future__ import annotations

import dataclasses

from vllm_deepinfer.patches.base import PatchUnavailable

UPSTREAM = "vllm.v1.metrics.stats.SchedulerStats"
FIELD = "deepinfer_moe_lb"


def apply() -> bool:
    """Idempotent. True once SchedulerStats declares the field."""
    try:
        from vllm.v1.metrics import stats
    except ImportError as exc:
        raise PatchUnavailable(f"vllm.v1.metrics.stats cannot be imported ({exc})") from exc
    cls = getattr(stats, "SchedulerStats", None)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise PatchUnavailable("vllm.v1.metrics.stats.SchedulerStats is missing or no "
                               "longer a dataclass")
    fields = cls.__dataclass_fields__
    if FIELD in fields:
        return True
    declared = list[float] | None
    field = dataclasses.field(default=None)
    field.name, field.type, field._field_type = FIELD, declared, dataclasses._FIELD
    fields[FIELD] = field
    cls.__annotations__[FIELD] = declared
    setattr(cls, FIELD, None)
    return True
