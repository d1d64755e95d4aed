"""DSpark's counts in the stats the engine core sends the front end.

The engine core's outputs are decoded by type (msgspec), so a `SpecDecodingStats`
subclass arrives as the base class and loses the fields only the DSpark proposer knows
(drafts proposed before variable-length verification, the confidence head's predictions
for the drafts verified). The patch declares `SchedulerStats.spec_decoding_stats` as the
plugin's `DSparkDecodingStats` (vLLM's fields plus those), in every process before any
decoder is built; plain `SpecDecodingStats` still encode, and decode with the extra
fields at zero.

Upstream symbol: vllm.v1.metrics.stats.SchedulerStats.spec_decoding_stats (its declared
type). Remove when vLLM's spec-decoding stats carry proposed drafts and confidences, or
let proposers attach their own stats.
"""
from __future__ import annotations

from vllm_deepinfer.patches.base import PatchUnavailable

UPSTREAM = "vllm.v1.metrics.stats.SchedulerStats.spec_decoding_stats"


def check_upstream():
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    field = getattr(SchedulerStats, "__dataclass_fields__", {}).get("spec_decoding_stats")
    if field is None or "spec_decoding_stats" not in vars(SchedulerStats):
        raise PatchUnavailable("SchedulerStats has no spec_decoding_stats field")
    return SchedulerStats, SpecDecodingStats, field


def apply() -> bool:
    from vllm_deepinfer.spec_decode.dspark.stats import DSparkDecodingStats

    SchedulerStats, SpecDecodingStats, field = check_upstream()
    declared = DSparkDecodingStats | None
    if SchedulerStats.__annotations__.get("spec_decoding_stats") == declared:
        return True
    if SchedulerStats.__annotations__.get("spec_decoding_stats") not in (
            SpecDecodingStats | None, "SpecDecodingStats | None"):
        raise PatchUnavailable("SchedulerStats.spec_decoding_stats is no longer declared "
                               "as SpecDecodingStats | None")
    SchedulerStats.__annotations__["spec_decoding_stats"] = declared
    field.type = declared
    return True
