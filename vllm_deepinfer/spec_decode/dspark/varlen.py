"""Variable-length verification: how many of each request's drafts the next step verifies.

A draft token is accepted only if every one before it is, so with the (recalibrated:
calibration.py) per-token acceptance probabilities c the chance that draft j is accepted
(its survival) is c_1 * ... * c_j, and verifying a request's first j drafts yields 1 + sum
of their survivals tokens on average (the 1: the token the target samples anyway).
Verifying costs step time (cost_model.py: t = a + b * tokens + c * requests). The plan
picks the global set of draft slots (best survival first; survival never grows along a
request, so every request keeps a prefix, possibly empty) that maximises expected tokens
per second of the cycle, as DeepSeek's adaptive verification does with profiled costs: the
cycle is the verifying step and the draft that precedes it (drafting recurs with every
step that drafts, so its time is part of what each verified token is weighed against).
Whether to draft at all is the gate's choice (draft_gate.py), made before drafting.

Guard: without a cost model yet, or where all drafts together would add under
`FREE_FRACTION` of the step's time (low load: extra verified tokens are nearly free),
every draft is verified.
"""

from __future__ import annotations

import torch

from vllm_deepinfer.spec_decode.dspark.cost_model import StepCost

FREE_FRACTION = 0.05


def verification_lengths(
    confidences: torch.Tensor, cost: StepCost | None, other_tokens: int = 0
) -> list[int]:
    """Per request, how many leading drafts to verify. confidences [B, K]; cost None:
    verify all; other_tokens: tokens the step runs besides these requests' rows (prefill
    chunks)."""
    b_reqs, k = confidences.shape
    if cost is None or b_reqs == 0:
        return [k] * b_reqs
    base_time = cost.target(b_reqs + other_tokens, b_reqs) + cost.draft(b_reqs)
    if cost.b * b_reqs * k <= FREE_FRACTION * base_time:
        return [k] * b_reqs
    survival = torch.cumprod(confidences.double().clamp(0, 1), dim=1).flatten()
    order = torch.sort(survival, descending=True, stable=True).indices
    gained = torch.cat([survival.new_zeros(1), survival[order].cumsum(0)])
    extra = torch.arange(len(gained), dtype=torch.float64)
    value = (b_reqs + gained) / (base_time + cost.b * extra)
    best = int(torch.argmax(value))
    lengths = torch.bincount(order[:best] // k, minlength=b_reqs)
    return lengths.tolist()
