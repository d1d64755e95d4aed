"""What DSpark counts beyond vLLM's own speculative-decoding stats, and how it travels.

vLLM counts drafts *scheduled* (= verified on the V1 runner, where a shorter draft list
really verifies fewer tokens) and accepted, in total and per position. Only the worker
knows how many drafts were *proposed* before variable-length verification cut them, and
what the confidence head predicted for the drafts that were then verified. The worker
counts both (`DraftCounters`), the runner attaches the step's counts to its output, the
plugin's scheduler folds them into the step's `DSparkDecodingStats` (vLLM's stats plus
these fields; patches/dspark_stats.py declares it in the engine's output type so it
survives the trip), and the stat logger (metrics.py) exports them.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from vllm.v1.spec_decode.metrics import SpecDecodingStats

RUNNER_OUTPUT_ATTR = "deepinfer_dspark"


@dataclass
class DSparkDecodingStats(SpecDecodingStats):
    num_proposed_tokens: int = 0
    """Draft tokens the draft proposed (before variable-length verification)."""
    num_calibrated_drafts: int = 0
    """Verified draft tokens whose outcome is known, with their predicted confidence."""
    confidence_sum: float = 0.0
    """Sum of the confidence head's acceptance probability over those drafts."""
    num_calibrated_accepted: int = 0
    """How many of those drafts were accepted."""

    @classmethod
    def extended(cls, stats: SpecDecodingStats, counters: "DraftCounters") -> "DSparkDecodingStats":
        base = {f.name: getattr(stats, f.name) for f in fields(SpecDecodingStats)}
        extra = DSparkDecodingStats(**base) if not isinstance(stats, cls) else stats
        extra.num_proposed_tokens += counters.proposed
        extra.num_calibrated_drafts += counters.calibrated
        extra.confidence_sum += counters.confidence_sum
        extra.num_calibrated_accepted += counters.accepted
        return extra


@dataclass
class DraftCounters:
    """The worker's counts since they were last taken."""
    proposed: int = 0
    calibrated: int = 0
    confidence_sum: float = 0.0
    accepted: int = 0

    def add(self, other: "DraftCounters") -> None:
        self.proposed += other.proposed
        self.calibrated += other.calibrated
        self.confidence_sum += other.confidence_sum
        self.accepted += other.accepted

    def __bool__(self) -> bool:
        return bool(self.proposed or self.calibrated)
