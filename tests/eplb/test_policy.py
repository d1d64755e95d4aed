"""The plugin's EPLB policy and the `moe_lb` arithmetic, against vLLM's own default
policy on the same loads."""

import numpy as np
import pytest
import torch
from vllm.distributed.eplb.eplb_state import EplbState
from vllm.distributed.eplb.policy import DefaultEplbPolicy

from tools.eplb_simulator import initial_placement
from vllm_deepinfer.eplb.balance import moe_lb, overall_moe_lb, rank_loads, replica_share
from vllm_deepinfer.eplb.policy import DeepInferEplbPolicy, pack, replicate, scenarios

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def fresh_policy():
    DeepInferEplbPolicy.forget()
    yield
    DeepInferEplbPolicy.forget()


def _zipf_loads(layers, experts, seed):
    rng = np.random.default_rng(seed)
    loads = np.empty((layers, experts))
    for layer in range(layers):
        loads[layer, rng.permutation(experts)] = 1e5 / np.arange(1, experts + 1)
    return loads


def _lb(placement, loads, ranks):
    return overall_moe_lb(rank_loads(loads, replica_share(placement, loads.shape[1], ranks)))


def test_moe_lb_is_the_busiest_rank_over_the_mean():
    # 4 experts on 2 ranks: expert 0 on both (its 8 tokens split 4/4), expert 3 twice
    # on rank 1 (its 5 tokens stay there).
    placement = np.array([[0, 1, 2, 0, 3, 3]])  # rank 0: slots 0-2, rank 1: slots 3-5
    share = replica_share(placement, 4, 2)
    np.testing.assert_allclose(share[0, 0], [0.5, 0.5])
    np.testing.assert_allclose(share[0, 3], [0.0, 1.0])
    loads = rank_loads(np.array([[8.0, 2.0, 1.0, 5.0]]), share)
    np.testing.assert_allclose(loads, [[7.0, 9.0]])
    assert moe_lb(loads)[0] == pytest.approx(9 / 8)
    assert moe_lb(np.zeros((1, 2)))[0] == 1.0
    with pytest.raises(ValueError, match="do not split evenly"):
        replica_share(placement, 4, 4)


def test_initial_placement_is_vllms():
    expected = EplbState.build_initial_global_physical_to_logical_map(10, 6)
    assert initial_placement(2, 10, 6).tolist() == [list(expected)] * 2


@pytest.mark.parametrize("experts,redundant,ranks", [(384, 64, 64), (64, 16, 8), (16, 0, 4)])
def test_placement_is_valid_and_balances_a_skewed_load(experts, redundant, ranks):
    loads = _zipf_loads(3, experts, seed=1)
    placement = DeepInferEplbPolicy.rebalance_experts(
        torch.from_numpy(loads), experts + redundant, 1, 1, ranks
    ).numpy()
    assert placement.shape == (3, experts + redundant)
    for row in placement:  # every expert served, every slot an expert
        assert set(row.tolist()) == set(range(experts))
    default = DefaultEplbPolicy.rebalance_experts(
        torch.from_numpy(loads), experts + redundant, 1, 1, ranks
    ).numpy()
    ours, theirs = _lb(placement, loads, ranks), _lb(default, loads, ranks)
    assert ours <= theirs + 1e-9
    none = _lb(initial_placement(3, experts, redundant), loads, ranks)
    assert ours < none
    if redundant >= ranks:  # enough copies to split the hot experts
        assert ours < 1.02


def test_the_placement_hedges_against_the_last_windows_traffic():
    """Traffic moves from mix A to mix B: the plugin, having seen both, serves either
    (and any mix of them) within its worst case; default, sized for B only, does worse on A."""
    a, b = _zipf_loads(1, 64, seed=2), _zipf_loads(1, 64, seed=3)
    DeepInferEplbPolicy.rebalance_experts(torch.from_numpy(a), 80, 1, 1, 8)
    ours = DeepInferEplbPolicy.rebalance_experts(torch.from_numpy(b), 80, 1, 1, 8).numpy()
    default = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(b), 80, 1, 1, 8).numpy()
    worst = max(_lb(ours, a, 8), _lb(ours, b, 8))
    assert worst < _lb(default, a, 8)
    for mix in (0.25, 0.5, 0.75):
        assert _lb(ours, mix * a + (1 - mix) * b, 8) <= worst + 1e-9


def test_history_is_kept_per_model_layout():
    loads = torch.from_numpy(_zipf_loads(2, 16, seed=4))
    DeepInferEplbPolicy.rebalance_experts(loads, 24, 1, 1, 4)
    DeepInferEplbPolicy.rebalance_experts(loads[:, :8], 8, 1, 1, 4)  # the drafter's layers
    assert sorted(len(h) for h in DeepInferEplbPolicy._history.values()) == [1, 1]


def test_experts_staying_on_a_rank_keep_their_slot():
    loads = torch.from_numpy(_zipf_loads(1, 32, seed=5))
    first = DeepInferEplbPolicy.rebalance_experts(loads, 40, 1, 1, 4)
    again = DeepInferEplbPolicy.rebalance_experts(loads, 40, 1, 1, 4, first).numpy()
    moved = (again != first.numpy()).sum()
    assert moved <= 4  # the same loads (now a second scenario) move almost nothing


def test_refuses_a_layout_vllm_could_not_hold():
    with pytest.raises(ValueError, match="cannot hold"):
        DeepInferEplbPolicy.rebalance_experts(torch.ones(1, 16), 18, 1, 1, 4)


def test_parts():
    loads = np.array([[8.0, 1.0, 1.0, 2.0]])
    assert replicate(loads, 6).tolist() == [3, 1, 1, 1]
    items = np.array([[4.0], [3.0], [3.0], [2.0], [2.0], [2.0]])
    rank = pack(items, 2)
    assert np.bincount(rank, weights=items[:, 0]).tolist() == [8.0, 8.0]
    history = np.array([[0.5, 0.5], [0.8, 0.2]])
    np.testing.assert_allclose(scenarios(history), [[0.5, 0.5], [0.8, 0.2], [1.0, 0.0]])
