"""Variable-length verification's choice of each request's verified prefix."""

import pytest
import torch

from vllm_deepinfer.spec_decode.dspark.cost_model import StepCost
from vllm_deepinfer.spec_decode.dspark.varlen import verification_lengths

pytestmark = pytest.mark.unit


def test_without_a_cost_model_every_draft_is_verified():
    assert verification_lengths(torch.full((3, 5), 0.01), None) == [5, 5, 5]


def test_nearly_free_tokens_are_all_verified():
    # 1 ms per step, 1 us per token: 15 extra tokens cost 1.5% of the step.
    assert verification_lengths(torch.full((3, 5), 0.01), StepCost(1e-3, 1e-6, 0.0)) == [5, 5, 5]


def test_costly_tokens_verify_the_prefixes_that_pay():
    confident = [0.99, 0.98, 0.97, 0.96, 0.95]
    doubtful = [0.05, 0.9, 0.9, 0.9, 0.9]
    middling = [0.95, 0.95, 0.3, 0.9, 0.9]
    lengths = verification_lengths(
        torch.tensor([confident, doubtful, middling]), StepCost(1e-3, 5e-4, 0.0)
    )
    assert lengths[0] == 5 and lengths[1] == 0 and lengths[2] == 2


def test_drafts_that_cannot_pay_are_not_verified_at_all():
    # A token costs as much as the step's fixed part: even likely drafts lose.
    assert verification_lengths(torch.full((4, 5), 0.6), StepCost(1e-3, 1e-3, 0.0)) == [0] * 4


def test_each_request_keeps_a_prefix_and_the_choice_maximises_the_rate():
    g = torch.Generator().manual_seed(0)
    confidences = torch.rand(16, 5, generator=g)
    cost = StepCost(2e-3, 4e-4, 1e-4)
    lengths = verification_lengths(confidences, cost)
    survival = torch.cumprod(confidences.double(), 1)

    def rate(ls):
        gained = sum(float(survival[i, :n].sum()) for i, n in enumerate(ls))
        return (16 + gained) / cost.target(16 + sum(ls), 16)

    best = rate(lengths)
    for i in range(16):  # no single request's length changed by one does better
        for step in (-1, 1):
            other = list(lengths)
            other[i] += step
            if 0 <= other[i] <= 5:
                assert rate(other) <= best + 1e-12


def test_the_drafts_own_time_counts_in_the_cycle():
    """Verified tokens are weighed against the step and the draft before it: a token
    that would not pay against the step alone pays when drafting took 10 ms."""
    confidences = torch.full((4, 5), 0.6)
    assert verification_lengths(confidences, StepCost(1e-3, 1e-3, 0.0)) == [0] * 4
    lengths = verification_lengths(confidences, StepCost(1e-3, 1e-3, 0.0, d=1e-2))
    assert all(n > 0 for n in lengths)
