"""Whether a step drafts at all: zero speculation is one of the plan's choices.

Variable-length verification (varlen.py) picks, after drafting, how many drafts each
request verifies; it cannot save the draft's own time. Before drafting, the gate compares
two predicted rates for the next cycle (draft now, verify next step), from the measured
cost model (cost_model.py) and the recent acceptance profile:
  without drafting:  B / target(B, B)
  with drafting:     max over L of  B * (1 + S_1 + ... + S_L)
                                   / (target(B + B * L, B) + draft(B))
where B is the requests that sampled this step and S_j the mean (recalibrated)
probability that draft j is accepted, over the last PROFILE_ROWS drafted requests. The
next step is predicted as decode only (a prefill chunk in this step makes verified
tokens look cheap, and is usually gone by the next), and a uniform L under-states what
the per-request plan achieves: the gate errs towards not drafting.

Hysteresis: drafting stops when the ratio (with / without) falls below 1 and resumes only
above 1 + RESUME_MARGIN. While stopped, the cost model still follows the load (a smaller
batch makes drafting pay again on its own), and a probe step drafts every `probe_every`
steps (doubling up to PROBE_MAX while probes find no gain) for PROBE_REQUESTS requests
(so that a probe at high load costs little); its drafts replace the stale profile, so a
change in the text's predictability is seen too: speculation is never switched off for good.

Every WINDOW decode steps the gate logs its choice, the predicted rates and the rate it
measured over the window (tokens sampled per second of step time), so a user can see why
it chose what it chose.
"""

from __future__ import annotations

import torch

from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.spec_decode.dspark.cost_model import StepCost

logger = init_logger(__name__)

PROFILE_ROWS = 256
RESUME_MARGIN = 0.05
PROBE_MIN = 16
PROBE_MAX = 256
PROBE_REQUESTS = 4  # a probe drafts for this many requests only: its draft stays cheap
WINDOW = 512


class DraftGate:
    def __init__(self, positions: int):
        self.positions = positions
        self.rows = torch.zeros(PROFILE_ROWS, positions, dtype=torch.float64)  # a ring
        self.filled = 0  # rows written so far
        self.survival: list[float] | None = None  # S_1..S_K
        self.drafting = True
        self.probing = False  # this step's draft is a probe
        self.since_probe = 0
        self.probe_every = PROBE_MIN
        self.last: tuple[float, float] | None = None  # predicted (with, without) rates
        self.window = _Window()

    def observe(self, calibrated: torch.Tensor) -> None:
        """The recalibrated acceptance probabilities [B, K] of a step's drafts."""
        if self.probing:  # the stale profile that stopped drafting gives way to the probe
            self.filled, self.probing = 0, False
        survival = torch.cumprod(calibrated.double().clamp(0, 1), 1)[-PROFILE_ROWS:]
        slots = (self.filled + torch.arange(len(survival))) % PROFILE_ROWS
        self.rows[slots, : survival.shape[1]] = survival
        self.filled += len(survival)
        self.survival = self.rows[: min(self.filled, PROFILE_ROWS)].mean(0).tolist()

    def rates(self, cost: StepCost, requests: int) -> tuple[float, float]:
        """Predicted tokens per second (with drafting, without) for the next cycle, once
        a survival profile has been observed."""
        assert self.survival is not None, "rates() before any observed drafts"
        without = requests / cost.target(requests, requests)
        draft_seconds = cost.draft(requests)
        with_drafts, gained = 0.0, 0.0
        for length, s in enumerate(self.survival, start=1):
            gained += s
            seconds = cost.target(requests * (1 + length), requests) + draft_seconds
            with_drafts = max(with_drafts, requests * (1 + gained) / seconds)
        return with_drafts, without

    def decide(self, cost: StepCost | None, requests: int) -> int:
        """How many of this step's `requests` draft: all, none, or a probe's few."""
        if cost is None or self.survival is None or requests == 0:
            self.last = None
            return requests  # nothing measured yet: draft, and learn
        self.last = with_drafts, without = self.rates(cost, requests)
        ratio = with_drafts / without
        if self.drafting and ratio < 1.0:
            self.drafting, self.since_probe, self.probe_every = False, 0, PROBE_MIN
        elif not self.drafting and ratio > 1.0 + RESUME_MARGIN:
            self.drafting = True
        if self.drafting:
            return requests
        self.since_probe += 1
        if self.since_probe < self.probe_every:
            return 0
        self.since_probe = 0
        self.probe_every = min(2 * self.probe_every, PROBE_MAX)
        self.probing = True
        return min(PROBE_REQUESTS, requests)

    def record(self, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode step's outcome: whether it drafted (any request), tokens sampled, its
        time."""
        self.window.add(drafted, tokens, seconds, self.last)
        if self.window.steps >= WINDOW:
            self.window.log(self.drafting)
            self.window = _Window()


class _Window:
    def __init__(self):
        self.steps = self.drafted = self.tokens = self.predicted_steps = 0
        self.seconds = self.predicted_with = self.predicted_without = 0.0

    def add(
        self, drafted: bool, tokens: int, seconds: float, predicted: tuple[float, float] | None
    ) -> None:
        self.steps += 1
        self.drafted += drafted
        self.tokens += tokens
        self.seconds += seconds
        if predicted is not None:
            self.predicted_steps += 1
            self.predicted_with += predicted[0]
            self.predicted_without += predicted[1]

    def log(self, drafting: bool) -> None:
        measured = self.tokens / self.seconds if self.seconds else 0.0
        if self.predicted_steps:
            n = self.predicted_steps
            predicted = (
                f"predicted {self.predicted_with / n:.1f} tok/s drafting vs "
                f"{self.predicted_without / n:.1f} without"
            )
        else:
            predicted = "no cost model yet (drafting to measure)"
        logger.info(
            "DSpark over %d decode steps: drafted in %d (%s now); %s; measured "
            "%.1f tok/s of step time",
            self.steps,
            self.drafted,
            "drafting" if drafting else "not drafting",
            predicted,
            measured,
        )
