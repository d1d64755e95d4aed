"""The measured cost model: target step and draft fitted apart, and its fit quality."""

import pytest

from vllm_deepinfer.spec_decode.dspark.cost_model import MIN_SAMPLES, StepCostModel

pytestmark = pytest.mark.unit


def seconds(tokens, requests):
    return 0.002 + 0.0001 * tokens + 0.0005 * requests


def draft_seconds(drafted):
    return 0.001 + 0.0002 * drafted


def test_the_cost_model_separates_per_token_per_request_and_draft_costs():
    model = StepCostModel()
    for i in range(MIN_SAMPLES):
        requests = 4 + i % 5
        tokens = requests + (i * 7) % 11  # drafts verified vary apart from requests
        drafted = requests if i % 3 else 0  # some steps skip drafting
        model.record(
            tokens,
            requests,
            seconds(tokens, requests),
            drafted,
            draft_seconds(drafted) if drafted else 0.0,
        )
    cost = model.fit()
    assert (cost.a, cost.b, cost.c) == (
        pytest.approx(0.002),
        pytest.approx(0.0001),
        pytest.approx(0.0005),
    )
    assert (cost.d, cost.e) == (pytest.approx(0.001), pytest.approx(0.0002))
    assert cost.draft(0) == 0.0
    assert model.quality.r2 == pytest.approx(1.0)
    assert model.quality.mean_relative_error == pytest.approx(0.0, abs=1e-9)


def test_while_every_draft_is_verified_the_slope_includes_per_request_costs():
    model = StepCostModel()
    for i in range(MIN_SAMPLES - 1):
        model.record(6 * (1 + i), 1 + i, seconds(6 * (1 + i), 1 + i))
    assert model.fit() is None  # too few samples
    model.record(6 * 20, 20, seconds(6 * 20, 20))
    cost = model.fit()
    assert (cost.a, cost.b, cost.c) == (
        pytest.approx(0.002),
        pytest.approx(0.0001 + 0.0005 / 6),
        0.0,
    )
    flat = StepCostModel()
    for _ in range(MIN_SAMPLES):
        flat.record(8, 2, 0.01)
    assert flat.fit() is None  # one token count: no slope to fit


def test_noisy_times_show_in_the_fit_quality():
    model = StepCostModel()
    for i in range(4 * MIN_SAMPLES):
        tokens = 1 + i % 9
        noise = 0.002 if i % 2 else -0.002
        model.record(tokens, 1, seconds(tokens, 1) + noise)
    assert model.quality.r2 < 0.5
    assert model.quality.mean_relative_error > 0.2


def test_a_slope_the_window_cannot_tell_apart_is_not_fitted():
    model = StepCostModel()
    for i in range(2 * MIN_SAMPLES):  # one request throughout: its cost is the intercept's
        tokens = 1 + i % 6
        model.record(tokens, 1, seconds(tokens, 1), 1, draft_seconds(1))
    cost = model.fit()
    assert (cost.a, cost.b, cost.c) == (pytest.approx(0.0025), pytest.approx(0.0001), 0.0)
    # One batch size drafted: no fixed part to tell apart, the draft scales with it.
    assert (cost.d, cost.e) == (0.0, pytest.approx(draft_seconds(1)))
    assert cost.draft(64) == pytest.approx(64 * draft_seconds(1))
