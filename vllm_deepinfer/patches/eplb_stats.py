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

from vllm_deepinfer.patches.base import declare_scheduler_stats_field

UPSTREAM = "vllm.v1.metrics.stats.SchedulerStats"
FIELD = "deepinfer_moe_lb"


def apply() -> bool:
    """Idempotent. True once SchedulerStats declares the field."""
    return declare_scheduler_stats_field(FIELD, list[float] | None)
