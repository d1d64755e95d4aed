"""What a decode step costs, measured: the target's step and the draft after it.

Each decode step is timed in two parts: the target's forward and sampling (from the
runner's `execute_model` until the proposer is called) and the draft stages (the
proposer's own drafting, planning included). Least squares over the last WINDOW steps:
- target: t = a + b * tokens + c * requests (tokens: verified drafts and sampled rows;
  while tokens and requests move together, as when every draft is verified or none is,
  or the batch size stays put, only t = a + b * tokens can be told apart, and b then
  carries both slopes);
- draft: t = d + e * drafted requests (t = e * drafted while one batch size has drafted).
Refitted every REFIT_EVERY steps. The fit's quality over the window (R^2 and the mean
relative error of the whole step's predicted time) is exported, so a user can see
whether the plan's predictions rest on a model that explains the measured times.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

WINDOW = 256
MIN_SAMPLES = 12
REFIT_EVERY = 16
OWN_VARIATION = 0.2


@dataclass(frozen=True)
class StepCost:
    """Fitted seconds: target step a + b * tokens + c * requests; draft d + e * drafted."""

    a: float
    b: float
    c: float
    d: float = 0.0
    e: float = 0.0

    def target(self, tokens: float, requests: float) -> float:
        return self.a + self.b * tokens + self.c * requests

    def draft(self, drafted: float) -> float:
        return self.d + self.e * drafted if drafted else 0.0


@dataclass(frozen=True)
class FitQuality:
    r2: float  # of the whole step's time (target + draft) over the window
    mean_relative_error: float


class StepCostModel:
    def __init__(self):
        # (tokens, requests, drafted requests, target seconds, draft seconds)
        self.samples: deque[tuple[int, int, int, float, float]] = deque(maxlen=WINDOW)
        self.since_fit = 0
        self.cost: StepCost | None = None
        self.quality: FitQuality | None = None

    def record(
        self,
        tokens: int,
        requests: int,
        target_seconds: float,
        drafted: int = 0,
        draft_seconds: float = 0.0,
    ) -> None:
        self.samples.append((tokens, requests, drafted, target_seconds, draft_seconds))
        self.since_fit += 1
        if self.since_fit >= REFIT_EVERY or self.cost is None:
            self.refit()

    def fit(self) -> StepCost | None:
        """The latest fit; None until the samples span enough distinct token counts."""
        return self.cost

    def refit(self) -> None:
        self.since_fit = 0
        if len(self.samples) < MIN_SAMPLES:
            return
        data = torch.tensor(list(self.samples), dtype=torch.float64)
        tokens, requests, drafted, target_s, draft_s = data.unbind(1)
        if tokens.max() - tokens.min() < 2:
            return
        a, b, c = _target_fit(tokens, requests, target_s)
        d, e = _draft_fit(drafted, draft_s)
        self.cost = StepCost(a, b, c, d, e)
        predicted = a + b * tokens + c * requests + torch.where(drafted > 0, d + e * drafted, 0.0)
        measured = target_s + draft_s
        spread = float(((measured - measured.mean()) ** 2).sum())
        residual = float(((measured - predicted) ** 2).sum())
        self.quality = FitQuality(
            r2=1.0 - residual / spread if spread > 0 else 1.0,
            mean_relative_error=float(((measured - predicted).abs() / measured).mean()),
        )


def _target_fit(tokens, requests, seconds) -> tuple[float, float, float]:
    """(a, b, c). The per-request slope c is fitted only where the window can tell it
    from the per-token one: requests vary, and tokens vary apart from them by at least
    OWN_VARIATION of their spread; a fit with a negative slope is refused (the slopes
    traded against each other) in favour of t = a + b * tokens."""
    ones = torch.ones_like(tokens)
    (a, b), c = _solve(torch.stack([ones, tokens], 1), seconds), 0.0
    if float(requests.max() - requests.min()) >= 2:
        basis = torch.stack([ones, requests], 1)
        own = tokens - basis @ torch.tensor(_solve(basis, tokens), dtype=basis.dtype)
        if float(own.std()) >= OWN_VARIATION * float(tokens.std()):
            full = _solve(torch.stack([ones, tokens, requests], 1), seconds)
            if min(full[1:]) >= 0:
                a, b, c = full
    return max(a, 1e-6), max(b, 0.0), c


def _draft_fit(drafted, seconds) -> tuple[float, float]:
    """(d, e) over the steps that drafted; (0, 0) before any did. While one batch size
    has drafted, t = e * drafted (no fixed part to tell apart: larger batches are then
    predicted dearer than they are, until a probe measures them)."""
    mask = drafted > 0
    if not bool(mask.any()):
        return 0.0, 0.0
    n, t = drafted[mask], seconds[mask]
    if n.max() == n.min():
        return 0.0, float(t.sum() / n.sum())
    d, e = _solve(torch.stack([torch.ones_like(n), n], 1), t)
    if d < 0 or e < 0:
        return 0.0, float(t.sum() / n.sum())
    return d, e


def _solve(design: torch.Tensor, target: torch.Tensor) -> list[float]:
    return torch.linalg.lstsq(design, target[:, None]).solution[:, 0].tolist()
