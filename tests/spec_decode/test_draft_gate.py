"""The gate: no draft at all when drafting cannot pay, every step when it is free, and
speculation back after a skipped stretch once it pays again (with hysteresis)."""

import pytest
import torch

from vllm_deepinfer.spec_decode.dspark.cost_model import StepCost
from vllm_deepinfer.spec_decode.dspark.draft_gate import (
    PROBE_BUDGET,
    PROBE_MAX,
    PROBE_MIN,
    PROBE_REQUESTS,
    DraftGate,
)

pytestmark = pytest.mark.unit

# Verifying a token costs a tenth of a step's fixed part and drafting a request as much: at
# 64 requests drafting loses even at 80% acceptance; at one request it pays.
COSTLY = StepCost(a=5e-3, b=5e-4, c=0.0, d=1e-3, e=5e-4)
FREE = StepCost(a=2e-3, b=0.0, c=0.0, d=0.0, e=0.0)


def gate_with(acceptance: float) -> DraftGate:
    gate = DraftGate(positions=5)
    gate.observe(torch.full((8, 5), acceptance))
    return gate


def steps(gate: DraftGate, cost: StepCost, requests: int, n: int) -> list[int]:
    """How many requests drafted at each of n steps."""
    return [gate.decide(cost, requests) for _ in range(n)]


def test_a_probes_few_draft_until_something_is_measured():
    gate = DraftGate(positions=5)
    assert steps(gate, COSTLY, 64, 3) == [PROBE_REQUESTS] * 3  # no acceptance profile yet
    assert steps(gate_with(0.8), None, 64, 3) == [PROBE_REQUESTS] * 3  # no cost model yet
    assert steps(gate_with(0.8), None, 2, 3) == [2] * 3  # a small batch drafts whole


def test_no_draft_when_drafting_cannot_pay_and_every_step_when_it_is_free():
    gate = gate_with(0.8)
    with_drafts, without = gate.rates(COSTLY, 64)
    assert with_drafts < without
    choices = steps(gate, COSTLY, 64, PROBE_MIN - 1)
    assert choices == [0] * (PROBE_MIN - 1)
    free = gate_with(0.3)
    assert steps(free, FREE, 64, 50) == [64] * 50


def test_probes_back_off_while_they_find_no_gain():
    gate = gate_with(0.8)
    choices = steps(gate, COSTLY, 64, 2000)
    probes = [i for i, drafted in enumerate(choices) if drafted]
    assert {choices[i] for i in probes} == {PROBE_REQUESTS}  # a few requests only
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    spacing = gate.probe_spacing(COSTLY, PROBE_REQUESTS, 64)
    assert 2 * PROBE_MIN < spacing < 4 * PROBE_MIN
    assert gaps[:2] == [spacing, 4 * PROBE_MIN] and gaps == sorted(gaps)
    assert gaps[-1] == PROBE_MAX
    assert len(probes) < 2000 / 50


def test_probes_cost_at_most_their_budget_of_the_step_time():
    """A probe drafts PROBE_REQUESTS requests and verifies their drafts next step: over
    the steps since the last probe, that costs at most PROBE_BUDGET of their time."""
    for cost in (COSTLY, StepCost(a=1e-3, b=1e-4, c=0.0, d=2e-2, e=5e-3)):
        for batch in (8, 16, 64):
            gate = gate_with(0.05)  # off at every load
            choices = steps(gate, cost, batch, 3000)
            probes = [i for i, drafted in enumerate(choices) if drafted]
            probe_seconds = cost.draft(PROBE_REQUESTS) + cost.b * PROBE_REQUESTS * 5
            step_seconds = cost.target(batch, batch)
            for a, b in zip(probes, probes[1:]):
                assert probe_seconds <= PROBE_BUDGET * (b - a) * step_seconds


def test_speculation_resumes_when_the_load_drops():
    gate = gate_with(0.8)
    assert not any(steps(gate, COSTLY, 64, 10))
    # One request: a step's fixed part dominates, and five likely drafts pay.
    with_drafts, without = gate.rates(COSTLY, 1)
    assert with_drafts > 1.05 * without
    assert all(steps(gate, COSTLY, 1, 10))


def test_the_requests_beside_the_drafts_count_against_them():
    """Four requests that could draft pay alone; beside 60 more that decode next step
    (they were prefilling), their drafts' verification and draft would slow all 64."""
    gate = gate_with(0.8)
    with_drafts, without = gate.rates(COSTLY, 4)
    assert with_drafts > 1.05 * without
    with_drafts, without = gate.rates(COSTLY, 4, 64)
    assert with_drafts < without
    assert gate.decide(COSTLY, 4, 64) == 0
    assert gate.decide(COSTLY, 4) == 4  # alone, they draft


def test_speculation_resumes_when_a_probe_finds_the_text_predictable_again():
    cost = StepCost(a=4e-3, b=4e-4, c=0.0, d=1e-3, e=1e-4)
    gate = gate_with(0.05)  # unpredictable text: off
    spacing = gate.probe_spacing(cost, PROBE_REQUESTS, 8)
    assert not any(steps(gate, cost, 8, spacing - 1))
    assert gate.decide(cost, 8) == PROBE_REQUESTS  # the probe
    gate.observe(torch.full((PROBE_REQUESTS, 5), 0.95))  # what the probe's drafts say now
    assert gate.rates(cost, 8)[0] > 1.05 * gate.rates(cost, 8)[1]
    assert all(steps(gate, cost, 8, 10))


def test_hysteresis_keeps_the_choice_in_the_band():
    gate = gate_with(0.8)
    cost = COSTLY
    # Find a batch size where drafting is just above break-even.
    ratios = {n: (lambda r: r[0] / r[1])(gate.rates(cost, n)) for n in range(1, 65)}
    inside = [n for n, r in ratios.items() if 1.0 < r < 1.05]
    assert inside, ratios
    n = inside[0]
    assert all(steps(gate, cost, n, 5))  # on stays on
    assert not any(steps(gate, cost, 64, 3))  # off at high load
    assert not any(steps(gate, cost, n, 5))  # off stays off inside the band
