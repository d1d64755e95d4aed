"""DSpark's counts in the stats the engine core sends the front end.

The engine core's outputs are decoded by type (msgspec), so an attribute vLLM's
`SchedulerStats` does not declare is dropped on the way to the front end's stat loggers.
The patch declares one more field, `deepinfer_dspark: DraftCounters | None = None` (what
only the DSpark proposer knows: drafts proposed before variable-length verification,
decode steps that ran no draft, the confidence head's predictions and calibration error,
the cost model's fit: vllm_deepinfer/spec_decode/dspark/stats.py), in every process before
any encoder or decoder is built; stats without it encode and decode as before. A field of
its own, not a subclass of vLLM's `SpecDecodingStats`, because steps that verify no draft
carry no speculative-decoding stats (vLLM's loggers divide by the drafts), and a stretch
of steps that skip drafting is exactly what these counts must report.

Upstream symbol: vllm.v1.metrics.stats.SchedulerStats (a dataclass). Remove when vLLM's
scheduler stats let a proposer attach stats of its own.
"""

from __future__ import annotations

from vllm_deepinfer.patches.base import declare_scheduler_stats_field

UPSTREAM = "vllm.v1.metrics.stats.SchedulerStats"
FIELD = "deepinfer_dspark"


def apply() -> bool:
    """Idempotent. True once SchedulerStats declares the field."""
    from vllm_deepinfer.spec_decode.dspark.stats import DraftCounters

    return declare_scheduler_stats_field(FIELD, DraftCounters | None)
