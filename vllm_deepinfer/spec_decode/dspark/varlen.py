"""Variable-length verification: how many of each request's drafts the next step verifies.

A draft token is accepted only if every one before it is, so with the confidence head's
per-token acceptance probabilities c the chance that draft j is accepted (its survival) is
c_1 * ... * c_j, and verifying a request's first j drafts yields 1 + sum of their survivals
tokens on average (the 1: the token the target samples anyway). Verifying costs step time:
`StepCostModel` fits t = a + b * tokens + c * requests to the measured times of recent
decode steps (per-request work, such as drafting, apart from per-token verification;
while tokens and requests move together, as when every draft is verified, it fits
t = a + b * tokens and b includes both).
The plan picks the global set of draft slots (best survival first; survival never grows
along a request, so every request keeps a prefix) that maximises expected tokens per
second of step time, as DeepSeek's adaptive verification does with profiled costs.

The confidence head was trained offline; how well its probabilities match this target on
this traffic is only seen online. `Recalibration` fits a logistic map of the head's
log-odds (Platt scaling) to the verdicts of recent verified drafts (accepted, or the first
rejected; later ones say nothing about their own chance) and the plan uses the mapped
probabilities.

Guard: while the fit has too few or too uniform samples, or where all drafts together
would add under `FREE_FRACTION` of the step's time (low load: extra verified tokens are
nearly free), every draft is verified.
"""
from __future__ import annotations

from collections import deque

import torch

FREE_FRACTION = 0.05
MIN_SAMPLES = 12
WINDOW = 256
CALIBRATION_WINDOW = 2048
CALIBRATION_MIN = 64


class Recalibration:
    """p = sigmoid(w * logit(c) + b) over the last CALIBRATION_WINDOW verdicts; the
    identity until CALIBRATION_MIN of them, with both outcomes, are in."""

    def __init__(self):
        self.verdicts: deque[tuple[float, float]] = deque(maxlen=CALIBRATION_WINDOW)
        self.weight, self.bias = 1.0, 0.0
        self.unfitted = 0  # verdicts since the last fit

    def observe(self, confidences: list[float], accepted: int) -> None:
        """A request's verified drafts' confidences and how many of them were accepted."""
        for i, c in enumerate(confidences[: accepted + 1]):
            self.verdicts.append((c, float(i < accepted)))
            self.unfitted += 1

    def refit(self) -> None:
        """Refits on the window when verdicts came in since the last fit."""
        if len(self.verdicts) < CALIBRATION_MIN or not self.unfitted:
            return
        self.unfitted = 0
        data = torch.tensor(list(self.verdicts), dtype=torch.float64)
        x, y = _logit(data[:, 0]), data[:, 1]
        if y.min() == y.max():
            return
        w = torch.tensor([self.weight, self.bias], dtype=torch.float64)
        design = torch.stack([x, torch.ones_like(x)], 1)
        for _ in range(8):  # Newton steps on the log-loss, lightly regularised
            p = torch.sigmoid(design @ w)
            grad = design.T @ (p - y) + 1e-3 * (w - torch.tensor([1.0, 0.0]))
            hess = design.T @ (design * (p * (1 - p))[:, None]) + 1e-3 * torch.eye(2)
            w = w - torch.linalg.solve(hess, grad)
        self.weight, self.bias = float(w[0]), float(w[1])

    def __call__(self, confidences: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.weight * _logit(confidences.double()) + self.bias)


def _logit(c: torch.Tensor) -> torch.Tensor:
    c = c.clamp(1e-6, 1 - 1e-6)
    return torch.log(c / (1 - c))


class StepCostModel:
    """Least squares over the last WINDOW decode steps: (tokens, requests, seconds)."""

    def __init__(self):
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)

    def record(self, tokens: int, requests: int, seconds: float) -> None:
        self.samples.append((tokens, requests, seconds))

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c), or None until the samples span enough distinct token counts."""
        if len(self.samples) < MIN_SAMPLES:
            return None
        data = torch.tensor(list(self.samples), dtype=torch.float64)
        tokens, requests, seconds = data[:, 0], data[:, 1], data[:, 2]
        if tokens.max() - tokens.min() < 2:
            return None
        ones = torch.ones_like(tokens)
        # Tokens apart from what the request count explains: is there a per-token slope
        # of its own to see?
        basis = torch.stack([ones, requests], 1)
        own = tokens - basis @ torch.linalg.lstsq(basis, tokens[:, None]).solution[:, 0]
        if float(own.abs().max()) >= 1.0:
            design = torch.stack([ones, tokens, requests], 1)
            a, b, c = torch.linalg.lstsq(design, seconds[:, None]).solution[:, 0].tolist()
        else:
            design = torch.stack([ones, tokens], 1)
            (a, b), c = torch.linalg.lstsq(design, seconds[:, None]).solution[:, 0].tolist(), 0.0
        return max(a, 1e-6), max(b, 0.0), max(c, 0.0)


def verification_lengths(confidences: torch.Tensor,
                         cost: tuple[float, float, float] | None,
                         other_tokens: int = 0) -> list[int]:
    """Per request, how many leading drafts to verify. confidences [B, K]; cost (a, b, c)
    of t = a + b * tokens + c * requests, None: verify all; other_tokens: tokens the step
    runs besides these requests' rows (prefill chunks)."""
    b_reqs, k = confidences.shape
    if cost is None or b_reqs == 0:
        return [k] * b_reqs
    intercept, per_token, per_request = cost
    base_time = intercept + per_token * (b_reqs + other_tokens) + per_request * b_reqs
    if per_token * b_reqs * k <= FREE_FRACTION * base_time:
        return [k] * b_reqs
    survival = torch.cumprod(confidences.double().clamp(0, 1), dim=1).flatten()
    order = torch.sort(survival, descending=True, stable=True).indices
    gained = torch.cat([survival.new_zeros(1), survival[order].cumsum(0)])
    extra = torch.arange(len(gained), dtype=torch.float64)
    value = (b_reqs + gained) / (base_time + per_token * extra)
    best = int(torch.argmax(value))
    lengths = torch.bincount(order[:best] // k, minlength=b_reqs)
    return lengths.tolist()
