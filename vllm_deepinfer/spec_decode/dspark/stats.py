"""What DSpark counts beyond vLLM's own speculative-decoding stats, and how it travels.

vLLM counts drafts *scheduled* (= verified on the V1 runner, where a shorter draft list
really verifies fewer tokens) and accepted, in total and per position. Only the worker
knows how many drafts were *proposed* before variable-length verification cut them,
which decode steps ran no draft at all, what the confidence head predicted for the drafts
that were then verified, how well the recalibrated predictions match (ECE, per position)
and how well the cost model explains the measured step times. The worker counts these
(`DraftCounters`, with the latest windowed figures as `DraftGauges`), the runner attaches
the step's counts to its output, the plugin's scheduler puts them in the step's scheduler
stats (`deepinfer_dspark`, declared by patches/dspark_stats.py so it survives the
engine's typed encoding; steps that verify no draft carry none of vLLM's own
speculative-decoding stats), and the stat logger (metrics.py) exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RUNNER_OUTPUT_ATTR = "deepinfer_dspark"
STATS_FIELD = "deepinfer_dspark"  # on SchedulerStats (patches/dspark_stats.py)


@dataclass
class DraftGauges:
    """Figures over the proposer's recent window (the latest replaces older ones)."""

    ece_raw: float | None = None
    """Expected calibration error of the confidence head's own probabilities."""
    ece_calibrated: float | None = None
    """The same for the recalibrated probabilities the plan used."""
    predicted_per_pos: list[float] = field(default_factory=list)
    """Mean recalibrated acceptance probability per draft position (drafts with a verdict)."""
    observed_per_pos: list[float] = field(default_factory=list)
    """Observed acceptance per draft position over the same drafts."""
    cost_fit_r2: float | None = None
    """R^2 of the cost model's predicted decode-step times against the measured ones."""
    cost_fit_error: float | None = None
    """Mean relative error of those predictions."""


@dataclass
class DraftCounters:
    """The worker's counts since they were last taken."""

    proposed: int = 0
    """Draft tokens the draft proposed (within each request's room before its length
    limit; before variable-length verification)."""
    calibrated: int = 0
    """Verified draft tokens whose outcome is known, with their predicted confidence."""
    confidence_sum: float = 0.0
    """Sum of the confidence head's own acceptance probability over those drafts."""
    accepted: int = 0
    """How many of those drafts were accepted."""
    decode_steps: int = 0
    """Steps in which at least one request could draft (it sampled a token and has
    tokens left to generate past the next)."""
    skipped_steps: int = 0
    """Of those, steps that ran no draft (the gate found drafting would not pay)."""
    request_steps: int = 0
    """Requests that sampled a token, summed over steps."""
    gauges: DraftGauges | None = None

    def add(self, other: DraftCounters) -> None:
        self.proposed += other.proposed
        self.calibrated += other.calibrated
        self.confidence_sum += other.confidence_sum
        self.accepted += other.accepted
        self.decode_steps += other.decode_steps
        self.skipped_steps += other.skipped_steps
        self.request_steps += other.request_steps
        self.gauges = other.gauges or self.gauges

    def __bool__(self) -> bool:
        return bool(self.proposed or self.calibrated or self.decode_steps)
