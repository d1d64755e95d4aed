"""Whether a step drafts at all: zero speculation is one of the plan's choices.

Variable-length verification (varlen.py) picks, after drafting, how many drafts each
request verifies; it cannot save the draft's own time. Before drafting, the gate compares
two predicted rates for the next cycle (draft now, verify next step), from the measured
cost model (cost_model.py) and the recent acceptance profile:
  without drafting:  N / target(N, N)
  with drafting:     max over L of  (N + B * (S_1 + ... + S_L))
                                   / (target(N + B * L, N) + draft(B))
where B is the requests that could draft (they sampled this step and have tokens left to
generate past the next), N the requests the step scheduled (prefill chunks included: they
decode beside the drafts next step) and S_j the mean (recalibrated) probability that
draft j is accepted, over the last PROFILE_ROWS drafted requests. The
next step is predicted as decode only (a prefill chunk in this step makes verified
tokens look cheap, and is usually gone by the next), and a uniform L under-states what
the per-request plan achieves: the gate errs towards not drafting.

Hysteresis: drafting stops when the ratio (with / without) falls below 1 and resumes only
above 1 + RESUME_MARGIN. While stopped, the cost model still follows the load (a smaller
batch makes drafting pay again on its own), and a probe step drafts for PROBE_REQUESTS
requests (the first steps, before anything is measured, draft as probes do) every
`probe_every` steps, doubling up to PROBE_MAX while probes find no gain. Probes are never
closer than `probe_spacing`, which holds their cost (a probe's draft takes about as long
as a step here) within PROBE_BUDGET of the step time. A probe's drafts replace the stale
profile, so a change in the text's predictability is seen too: speculation is never
switched off for good.

Every WINDOW decode steps the gate logs its choice, the predicted rates and the rate it
measured over the window (tokens sampled per second of step time), so a user can see why
it chose what it chose.
"""

from __future__ import annotations

import math

import torch

from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.spec_decode.dspark.cost_model import StepCost

logger = init_logger(__name__)

PROFILE_ROWS = 256
RESUME_MARGIN = 0.05
PROBE_MIN = 16
PROBE_MAX = 256
PROBE_REQUESTS = 4  # a probe drafts for this many requests only: its draft stays cheap
PROBE_BUDGET = 0.01  # what probes may cost, as a fraction of the step time between them
WINDOW = 512


def decoding(requests: int, batch: int | None) -> int:
    """The requests decoding next step: the step's batch, never fewer than those that
    draft."""
    return max(batch or requests, requests)


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

    def rates(self, cost: StepCost, requests: int, batch: int | None = None) -> tuple[float, float]:
        """Predicted tokens per second (with drafting, without) for the next cycle, once
        a survival profile has been observed: `requests` draft, `batch` (at least as
        many; default as many) decode next step."""
        assert self.survival is not None, "rates() before any observed drafts"
        batch = decoding(requests, batch)
        without = batch / cost.target(batch, batch)
        draft_seconds = cost.draft(requests)
        with_drafts, gained = 0.0, 0.0
        for length, s in enumerate(self.survival, start=1):
            gained += s
            seconds = cost.target(batch + requests * length, batch) + draft_seconds
            with_drafts = max(with_drafts, (batch + requests * gained) / seconds)
        return with_drafts, without

    def decide(self, cost: StepCost | None, requests: int, batch: int | None = None) -> int:
        """How many of this step's `requests` (those that could draft) draft: all, none,
        or a probe's few; `batch` is the requests the step scheduled."""
        batch = decoding(requests, batch)
        if cost is None or self.survival is None or requests == 0:
            self.last = None
            # Nothing measured yet: a probe's few draft, and the gate learns. All of a
            # full batch drafting blind cost 0.25 s a step at 64 requests here.
            return min(PROBE_REQUESTS, requests)
        self.last = with_drafts, without = self.rates(cost, requests, batch)
        ratio = with_drafts / without
        if self.drafting and ratio < 1.0:
            self.drafting, self.since_probe, self.probe_every = False, 0, PROBE_MIN
        elif not self.drafting and ratio > 1.0 + RESUME_MARGIN:
            self.drafting = True
        if self.drafting:
            return requests
        self.since_probe += 1
        probe = min(PROBE_REQUESTS, requests)
        spacing = self.probe_spacing(cost, probe, batch)
        if self.since_probe < max(self.probe_every, spacing):
            return 0
        self.since_probe = 0
        self.probe_every = min(2 * self.probe_every, PROBE_MAX)
        self.probing = True
        return probe

    def probe_spacing(self, cost: StepCost, probe: int, batch: int) -> int:
        """The fewest steps of `batch` requests between probes of `probe` requests for
        which a probe (its draft and the verification of its drafts) costs at most
        PROBE_BUDGET of the steps' time."""
        probe_seconds = cost.draft(probe) + cost.b * probe * self.positions
        return math.ceil(probe_seconds / (PROBE_BUDGET * cost.target(batch, batch)))

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
