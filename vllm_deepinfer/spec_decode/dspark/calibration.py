"""The confidence head's probabilities, recalibrated online, and how well they match.

The head was trained offline; how well its probabilities match this target on this
traffic is only seen online (on the trained pair it says 0.89 where 0.66 are accepted).
`Recalibration` fits p = sigmoid(w * logit(c) + b_position) (Platt scaling with a bias
per draft position, so that mean predicted and observed acceptance agree at every
position) to the verdicts of recent verified drafts: accepted, or the first rejected;
later ones say nothing about their own chance.

Each verdict keeps the calibrated probability the plan used when the draft was made
(not a refit's hindsight), so the expected calibration error (ECE) over the window
measures the predictions as they were acted on, beside the raw head's.
"""

from __future__ import annotations

from collections import deque

import torch

WINDOW = 2048
MIN_VERDICTS = 64
REFIT_EVERY = 64  # new verdicts between refits (a refit is a few ms of Newton steps)
ECE_BINS = 10
RIDGE = 1e-3
NEWTON_STEPS = 12


class Recalibration:
    """The identity until MIN_VERDICTS verdicts, with both outcomes, are in."""

    def __init__(self, positions: int):
        self.positions = positions
        # (raw confidence, calibrated prediction used, position, accepted)
        self.verdicts: deque[tuple[float, float, int, float]] = deque(maxlen=WINDOW)
        self.weight = 1.0
        self.bias = torch.zeros(positions, dtype=torch.float64)
        self.unfitted = 0

    def __call__(self, confidences: torch.Tensor) -> torch.Tensor:
        """Calibrated acceptance probabilities of drafts [B, K] (K <= positions)."""
        k = confidences.shape[-1]
        return torch.sigmoid(self.weight * _logit(confidences.double()) + self.bias[:k])

    def observe(self, raw: list[float], calibrated: list[float], accepted: int) -> None:
        """A request's verified drafts (raw and calibrated confidences, in draft order)
        and how many of them were accepted."""
        for i in range(min(len(raw), accepted + 1)):
            self.verdicts.append((raw[i], calibrated[i], i, float(i < accepted)))
            self.unfitted += 1
        if self.unfitted >= REFIT_EVERY:
            self.refit()

    def refit(self) -> None:
        """Damped Newton steps on the window's log-loss, lightly pulled towards the identity."""
        self.unfitted = 0
        if len(self.verdicts) < MIN_VERDICTS:
            return
        data = torch.tensor(list(self.verdicts), dtype=torch.float64)
        y = data[:, 3]
        if y.min() == y.max():
            return
        k = self.positions
        design = torch.cat(
            [
                _logit(data[:, 0])[:, None],
                torch.nn.functional.one_hot(data[:, 2].long(), k).double(),
            ],
            1,
        )
        prior = torch.cat([torch.ones(1, dtype=torch.float64), torch.zeros(k, dtype=torch.float64)])
        w = torch.cat([torch.tensor([self.weight], dtype=torch.float64), self.bias])
        eye = torch.eye(k + 1, dtype=torch.float64)

        def loss(w):
            z = design @ w
            return float(
                (torch.nn.functional.softplus(z) - y * z).sum()
                + RIDGE / 2 * ((w - prior) ** 2).sum()
            )

        current = loss(w)
        for _ in range(NEWTON_STEPS):  # damped: a full step may overshoot
            p = torch.sigmoid(design @ w)
            grad = design.T @ (p - y) + RIDGE * (w - prior)
            hess = design.T @ (design * (p * (1 - p))[:, None]) + RIDGE * eye
            step, scale = torch.linalg.solve(hess, grad), 1.0
            while scale > 1e-3 and loss(w - scale * step) > current:
                scale /= 2
            if scale <= 1e-3:
                break
            w = w - scale * step
            current = loss(w)
        self.weight, self.bias = float(w[0]), w[1:].clone()

    def ece(self) -> tuple[float, float] | None:
        """(raw, calibrated) expected calibration error over the window's verdicts:
        |mean prediction - acceptance| per confidence bin, weighted by the bin's share."""
        if not self.verdicts:
            return None
        data = torch.tensor(list(self.verdicts), dtype=torch.float64)
        return (
            expected_calibration_error(data[:, 0], data[:, 3]),
            expected_calibration_error(data[:, 1], data[:, 3]),
        )

    def per_position(self) -> list[tuple[int, float, float]]:
        """(verdicts, mean calibrated prediction, acceptance) per draft position."""
        out = []
        for i in range(self.positions):
            rows = [(p, y) for _, p, pos, y in self.verdicts if pos == i]
            n = len(rows)
            out.append(
                (
                    n,
                    sum(p for p, _ in rows) / n if n else 0.0,
                    sum(y for _, y in rows) / n if n else 0.0,
                )
            )
        return out


def expected_calibration_error(
    predicted: torch.Tensor, accepted: torch.Tensor, bins: int = ECE_BINS
) -> float:
    index = (predicted.clamp(0, 1) * bins).long().clamp(max=bins - 1)
    count = torch.bincount(index, minlength=bins).double()
    gap = (
        torch.bincount(index, predicted, minlength=bins)
        - torch.bincount(index, accepted, minlength=bins)
    ).abs()
    return float(gap.sum() / count.sum())


def _logit(c: torch.Tensor) -> torch.Tensor:
    c = c.clamp(1e-6, 1 - 1e-6)
    return torch.log(c / (1 - c))
