"""The MoE layer's side of EPLB (replica routing, load recording) and the `moe_lb` figures'
trip from the workers to the stat logger."""

import pytest
import torch
from vllm.v1.metrics.stats import SchedulerStats

from vllm_deepinfer.eplb import metrics
from vllm_deepinfer.eplb.load import ExpertLoadBalancing

pytestmark = pytest.mark.unit


def _balancing(record: bool = True) -> ExpertLoadBalancing:
    """3 logical experts over 5 physical: expert 0 at slots 0 and 3, expert 2 at 2 and 4."""
    balancing = ExpertLoadBalancing()
    l2p = torch.tensor([[[0, 3], [1, -1], [2, 4]]])
    count = torch.tensor([[2, 1, 2]])
    load = torch.zeros(1, 5, dtype=torch.int64)
    balancing.state.set_layer_state(0, load, l2p, count)
    balancing.state.should_record_tensor = torch.tensor(record)
    return balancing


def test_without_eplb_logical_experts_are_physical():
    chosen = torch.tensor([[0, 2], [1, 0]])
    assert ExpertLoadBalancing().physical(chosen) is chosen


def test_tokens_spread_over_replicas_and_the_load_is_recorded():
    balancing = _balancing()
    chosen = torch.tensor([[0, 2], [0, 1], [0, 2], [2, 1]])
    physical = balancing.physical(chosen)
    # Token t takes replica t % count of each of its experts.
    assert physical.tolist() == [[0, 2], [3, 1], [0, 2], [4, 1]]
    assert balancing.state.expert_load_view.tolist() == [2, 2, 2, 1, 1]


def test_nothing_is_recorded_while_vllm_does_not_ask():
    balancing = _balancing(record=False)
    balancing.physical(torch.tensor([[0, 2]]))
    assert balancing.state.expert_load_view.sum() == 0


def test_figures_reach_the_stats_and_the_gauges(monkeypatch):
    from vllm_deepinfer.patches import eplb_stats

    eplb_stats.apply()
    output = type("Output", (), {})()
    assert metrics.attach(output, [1.25, 1.5, 1.0]) is output
    assert getattr(output, metrics.RUNNER_OUTPUT_ATTR) == [1.25, 1.5, 1.0]

    class Later:  # an asynchronous step's output
        def get_output(self):
            return output

    later = metrics.attach(Later(), [1.1, 1.1])
    assert getattr(later.get_output(), metrics.RUNNER_OUTPUT_ATTR) == [1.1, 1.1]

    stats = SchedulerStats()
    setattr(stats, metrics.STATS_FIELD, [1.25, 1.5, 1.0])
    metrics.MoeBalanceStatLogger(None, 3).record(stats, None, engine_idx=3)
    assert metrics.MOE_LB_OVERALL.labels(engine="3")._value.get() == 1.25
    assert metrics.MOE_LB.labels(engine="3", layer="0")._value.get() == 1.5
    assert metrics.MOE_LB.labels(engine="3", layer="1")._value.get() == 1.0
