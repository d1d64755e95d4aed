"""Variable-length verification's choice and its cost model."""
import pytest
import torch

from vllm_deepinfer.spec_decode.dspark.varlen import (CALIBRATION_MIN, MIN_SAMPLES,
                                                      Recalibration, StepCostModel,
                                                      verification_lengths)

pytestmark = pytest.mark.unit


def test_without_a_cost_model_every_draft_is_verified():
    assert verification_lengths(torch.full((3, 5), 0.01), None) == [5, 5, 5]


def test_nearly_free_tokens_are_all_verified():
    # 1 ms per step, 1 us per token: 15 extra tokens cost 1.5% of the step.
    assert verification_lengths(torch.full((3, 5), 0.01), (1e-3, 1e-6, 0.0)) == [5, 5, 5]


def test_costly_tokens_verify_the_prefixes_that_pay():
    confident = [0.99, 0.98, 0.97, 0.96, 0.95]
    doubtful = [0.05, 0.9, 0.9, 0.9, 0.9]
    middling = [0.95, 0.95, 0.3, 0.9, 0.9]
    lengths = verification_lengths(torch.tensor([confident, doubtful, middling]), (1e-3, 5e-4, 0.0))
    assert lengths[0] == 5 and lengths[1] == 0 and lengths[2] == 2


def test_each_request_keeps_a_prefix_and_the_choice_maximises_the_rate():
    g = torch.Generator().manual_seed(0)
    confidences = torch.rand(16, 5, generator=g)
    cost = (2e-3, 4e-4, 1e-4)
    lengths = verification_lengths(confidences, cost)
    survival = torch.cumprod(confidences.double(), 1)

    def rate(ls):
        gained = sum(float(survival[i, :n].sum()) for i, n in enumerate(ls))
        return (16 + gained) / (cost[0] + cost[1] * (16 + sum(ls)) + cost[2] * 16)

    best = rate(lengths)
    for i in range(16):  # no single request's length changed by one does better
        for step in (-1, 1):
            other = list(lengths)
            other[i] += step
            if 0 <= other[i] <= 5:
                assert rate(other) <= best + 1e-12


def seconds(tokens, requests):
    return 0.002 + 0.0001 * tokens + 0.0005 * requests


def test_the_cost_model_separates_per_token_and_per_request_costs():
    model = StepCostModel()
    for i in range(MIN_SAMPLES):
        requests = 4 + i % 5
        tokens = requests + (i * 7) % 11  # drafts verified vary apart from requests
        model.record(tokens, requests, seconds(tokens, requests))
    a, b, c = model.fit()
    assert (a, b, c) == (pytest.approx(0.002), pytest.approx(0.0001), pytest.approx(0.0005))


def test_while_every_draft_is_verified_the_slope_includes_per_request_costs():
    model = StepCostModel()
    for i in range(MIN_SAMPLES - 1):
        model.record(6 * (1 + i), 1 + i, seconds(6 * (1 + i), 1 + i))
    assert model.fit() is None  # too few samples
    model.record(6 * 20, 20, seconds(6 * 20, 20))
    a, b, c = model.fit()
    assert (a, b, c) == (pytest.approx(0.002), pytest.approx(0.0001 + 0.0005 / 6), 0.0)
    flat = StepCostModel()
    for _ in range(MIN_SAMPLES):
        flat.record(8, 2, 0.01)
    assert flat.fit() is None  # one token count: no slope to fit


def test_recalibration_learns_how_far_the_head_overstates_acceptance():
    calibration = Recalibration()
    c = torch.tensor([0.9, 0.6])
    assert torch.allclose(calibration(c), c.double())  # identity before any verdict
    g = torch.Generator().manual_seed(1)
    for _ in range(200):  # the head says 0.9 where 60% are accepted, 0.6 where 20% are
        calibration.observe([0.9], int(torch.rand(1, generator=g) < 0.6))
        calibration.observe([0.6], int(torch.rand(1, generator=g) < 0.2))
    assert len(calibration.verdicts) >= CALIBRATION_MIN
    calibration.refit()
    high, low = calibration(c).tolist()
    assert abs(high - 0.6) < 0.08 and abs(low - 0.2) < 0.08


def test_only_verdicts_that_speak_to_a_draft_are_kept():
    calibration = Recalibration()
    calibration.observe([0.9, 0.8, 0.7, 0.6], accepted=1)  # 2nd rejected, 3rd and 4th unknown
    assert [y for _, y in calibration.verdicts] == [1.0, 0.0]
