"""Online recalibration of the confidence head and its calibration error."""

import pytest
import torch

from vllm_deepinfer.spec_decode.dspark.calibration import (
    MIN_VERDICTS,
    Recalibration,
    expected_calibration_error,
)

pytestmark = pytest.mark.unit


def test_recalibration_learns_how_far_the_head_overstates_acceptance_per_position():
    calibration = Recalibration(positions=2)
    c = torch.tensor([[0.9, 0.9], [0.6, 0.6]])
    assert torch.allclose(calibration(c), c.double())  # identity before any verdict
    g = torch.Generator().manual_seed(1)
    # Position 0: the head says 0.9 where 60% are accepted, 0.6 where 20% are. Position 1
    # (reached after an acceptance): 0.9 where 80% are.
    for _ in range(300):  # as the proposer does: predictions made with the map of the time
        first = int(torch.rand(1, generator=g) < 0.6)
        second = int(torch.rand(1, generator=g) < 0.8)
        now_high, now_low = calibration(c).tolist()
        calibration.observe([0.9, 0.9], now_high, first + first * second)
        calibration.observe([0.6], now_low[:1], int(torch.rand(1, generator=g) < 0.2))
    (high, high_second), (low, _) = calibration(c).tolist()
    assert abs(high - 0.6) < 0.08 and abs(low - 0.2) < 0.08
    assert abs(high_second - 0.8) < 0.08
    for n, predicted, observed in calibration.per_position():
        assert n > MIN_VERDICTS
        assert abs(predicted - observed) < 0.05
    raw, calibrated = calibration.ece()
    assert raw > 0.2 and calibrated < 0.08  # the first verdicts were predicted raw


def test_only_verdicts_that_speak_to_a_draft_are_kept():
    calibration = Recalibration(positions=4)
    calibration.observe([0.9, 0.8, 0.7, 0.6], [0.5] * 4, accepted=1)  # 2nd rejected
    assert [(pos, y) for _, _, pos, y in calibration.verdicts] == [(0, 1.0), (1, 0.0)]


def test_ece_is_the_binned_gap_between_prediction_and_outcome():
    predicted = torch.tensor([0.9, 0.9, 0.9, 0.9, 0.15, 0.15])
    accepted = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    # Bin 0.9: 4 drafts, predicted 0.9, observed 0.5; bin 0.1: 2 drafts, 0.15 vs 0.5.
    want = (4 * 0.4 + 2 * 0.35) / 6
    assert expected_calibration_error(predicted, accepted) == pytest.approx(want)
    calibration = Recalibration(positions=1)
    for p, y in zip(predicted.tolist(), accepted.tolist()):
        calibration.observe([p], [0.5], int(y))
    raw, calibrated = calibration.ece()
    assert raw == pytest.approx(want) and calibrated == pytest.approx(0.0)
