"""How V4.1's routed experts split, checked without processes: every rank's share of the
experts (or of their width) sums to the whole layer's output, data-parallel ranks with
fewer rows at the experts than they announced (decoder-side replay) still agree on the
collective's sizes, and the checkpoint loads into the slots vLLM's initial EPLB placement
gives each rank."""

import contextlib
import threading
import types

import pytest
import torch

from helpers import dense_experts
from vllm_deepinfer.model.deepseek_v41 import moe
from vllm_deepinfer.model.deepseek_v41.moe import expert_parallel_routed, grouped_experts
from vllm_deepinfer.model.deepseek_v41.parallel import ExpertPlacement, TensorSplit

pytestmark = pytest.mark.unit

E, K, H, I, T = 8, 2, 16, 12, 9


@pytest.fixture
def layer():
    torch.manual_seed(0)
    x = torch.randn(T, H)
    chosen = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    weights = torch.rand(T, K)
    return x, weights, chosen, torch.randn(E, 2 * I, H) / 4, torch.randn(E, H, I) / 4


@pytest.mark.parametrize("redundant", [0, 2])
def test_expert_parallel_ranks_sum_to_the_whole_layer(layer, redundant):
    x, weights, chosen, w13, w2 = layer
    whole = grouped_experts(x, weights, chosen, dense_experts(w13, w2), 10.0)
    total = torch.zeros_like(whole)
    for rank in range(2):
        placement = ExpertPlacement(E, E + redundant, 2, rank, TensorSplit(1, 0))
        held = placement.initial_logical()
        # Tokens of an expert with a copy here go to the copy: physical ids as EPLB maps.
        physical = chosen.clone()
        if redundant:
            copies = {expert: E + i for i, expert in enumerate(range(redundant))}
            use_copy = torch.arange(T)[:, None] % 2 == 1
            for expert, slot in copies.items():
                physical[(chosen == expert) & use_copy] = slot
        experts = dense_experts(w13[held], w2[held], placement)
        total += expert_parallel_routed(x, weights, physical, experts, 10.0)
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_widths_sum_to_the_whole_layer(layer):
    x, weights, chosen, w13, w2 = layer
    whole = grouped_experts(x, weights, chosen, dense_experts(w13, w2), 10.0)
    half = I // 2
    total = sum(
        grouped_experts(
            x,
            weights,
            chosen,
            dense_experts(
                torch.cat(
                    [w13[:, r * half : (r + 1) * half], w13[:, I + r * half : I + (r + 1) * half]],
                    1,
                ),
                w2[:, :, r * half : (r + 1) * half],
            ),
            10.0,
        )
        for r in range(2)
    )
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def test_placement_follows_vllms_initial_map():
    placement = ExpertPlacement(8, 10, 2, 1, TensorSplit(1, 0))
    assert (placement.local, placement.first) == (5, 5)
    assert placement.initial_logical() == [5, 6, 7, 0, 1]  # slots 8, 9: copies of 0, 1
    with pytest.raises(ValueError, match="does not split"):
        TensorSplit(3, 0).part(8, "o_groups")


def test_experts_load_this_ranks_share():
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_deepinfer.model.deepseek_v41.moe import V41Experts

    a = type("Args", (), {"moe_intermediate_size": I, "hidden_size": H})()
    with set_current_vllm_config(VllmConfig()):
        experts = V41Experts(a, ExpertPlacement(8, 10, 2, 1, TensorSplit(1, 0)))
        width = V41Experts(a, ExpertPlacement(8, 8, 1, 0, TensorSplit(2, 1)))
    w1, w3, w2 = torch.randn(I, H), torch.randn(I, H), torch.randn(H, I)
    assert all(experts.load(0, which, w, None) for which, w in (("w1", w1), ("w3", w3), ("w2", w2)))
    torch.testing.assert_close(experts.w13.data[3], torch.cat([w1, w3]))  # slot 8 = expert 0
    torch.testing.assert_close(experts.w2.data[3], w2)
    assert not experts.load(2, "w1", w1, None)  # expert 2 lives on rank 0 only
    width.load(4, "w1", w1, None)
    width.load(4, "w2", w2, None)
    torch.testing.assert_close(width.w13.data[4, : I // 2], w1[I // 2 :])
    torch.testing.assert_close(width.w2.data[4], w2[:, I // 2 :])


def test_mxfp4_experts_load_this_ranks_share_as_stored():
    """Under tensor parallelism each rank keeps its rows of w1/w3 and its columns of w2,
    packed, with the matching scale columns; the products equal the dequantized twin's."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_deepinfer.checkpoint.mx_formats import dequantize_mxfp4, quantize_mxfp4
    from vllm_deepinfer.model.deepseek_v41.moe import V41Experts
    from vllm_deepinfer.model.deepseek_v41.quantization import ReleaseMxConfig

    inter, hidden = 64, 64
    a = type("Args", (), {"moe_intermediate_size": inter, "hidden_size": hidden})()
    config = VllmConfig()
    config.quant_config = ReleaseMxConfig()
    with set_current_vllm_config(config):
        halves = [V41Experts(a, ExpertPlacement(2, 2, 1, 0, TensorSplit(2, r))) for r in range(2)]
    g = torch.Generator().manual_seed(1)
    stored = {
        which: quantize_mxfp4(torch.randn(shape, generator=g) / 8)
        for which, shape in (
            ("w1", (inter, hidden)),
            ("w3", (inter, hidden)),
            ("w2", (hidden, inter)),
        )
    }
    for half in halves:
        assert half.w13.dtype == torch.int8 and half.w13.shape == (2, inter, hidden // 2)
        for which, (values, scale) in stored.items():
            assert half.load(1, which, values, scale.view(torch.uint8))
    dense = {which: dequantize_mxfp4(*stored[which]) for which in stored}
    x = torch.randn(3, hidden, generator=g)
    gate_up = torch.cat([half.project(x, "w13", 1) for half in halves], -1)
    h = inter // 2
    expected = torch.cat([dense["w1"][:h], dense["w3"][:h], dense["w1"][h:], dense["w3"][h:]])
    torch.testing.assert_close(gate_up, x @ expected.T, rtol=1e-5, atol=1e-5)
    act = torch.randn(3, inter, generator=g)
    down = sum(half.project(act[:, r * h : (r + 1) * h], "w2", 1) for r, half in enumerate(halves))
    torch.testing.assert_close(down, act @ dense["w2"].T, rtol=1e-5, atol=1e-5)


class _TwoDataParallelRanks:
    """vLLM's EP all-gather / reduce-scatter between two data-parallel ranks run as
    threads: each rank's collective is sized by the counts the ranks announced (the
    forward context's `num_tokens_across_dp`), and a rank whose tensor differs from its
    announced count fails as vLLM's all-to-all manager does."""

    def __init__(self, announced):
        self.announced = announced
        self.local = threading.local()
        self.barrier = threading.Barrier(2, timeout=30)
        self.posted = [None, None]

    def _exchange(self, value):
        self.posted[self.local.rank] = value
        self.barrier.wait()
        both = list(self.posted)
        self.barrier.wait()
        return both

    def dispatch(self, x, weights, ids):
        assert x.shape[0] == self.announced[self.local.rank], "all-gather size check"
        both = self._exchange((x, weights, ids))
        return tuple(torch.cat(parts) for parts in zip(*both))

    def combine(self, out):
        total = sum(self._exchange(out))
        first = sum(self.announced[: self.local.rank])
        return total[first : first + self.announced[self.local.rank]]

    def install(self, monkeypatch):
        @contextlib.contextmanager
        def sizes(_):
            yield list(self.announced)

        context = types.SimpleNamespace(dp_metadata=types.SimpleNamespace(sp_local_sizes=sizes))
        monkeypatch.setattr(moe, "is_forward_context_available", lambda: True)
        monkeypatch.setattr(moe, "get_forward_context", lambda: context)
        monkeypatch.setattr(
            moe, "get_dp_group", lambda: types.SimpleNamespace(rank_in_group=self.local.rank)
        )
        monkeypatch.setattr(moe, "get_ep_group", lambda: self)
        monkeypatch.setattr(moe, "get_tensor_model_parallel_world_size", lambda: 1)

    def run(self, work):
        results, errors = [None, None], []

        def rank(r):
            self.local.rank = r
            try:
                results[r] = work(r)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


@pytest.mark.parametrize("pairs", [False, True])
def test_data_parallel_ranks_with_fewer_rows_than_announced(layer, pairs, monkeypatch):
    """Decoder-side replay leaves a rank fewer rows at the experts than it announced
    (rank 0: 4 of 9), or none (rank 1: 0 of 5, its chunk wholly before the kept rows):
    each still joins the collective at its announced size and gets its own rows' sum."""
    x, weights, chosen, w13, w2 = layer
    announced = [T, 5]
    rows = [torch.tensor([1, 4, 7, 8]), torch.tensor([], dtype=torch.long)]
    ranks = _TwoDataParallelRanks(announced)
    ranks.install(monkeypatch)

    def work(r):
        placement = ExpertPlacement(E, E, 2, r, TensorSplit(1, 0))
        held = placement.initial_logical()
        mine = rows[r]
        if pairs:
            per_pair = moe.expert_parallel_pairs(
                x[mine],
                weights[mine],
                chosen[mine],
                dense_experts(w13[held], w2[held], placement),
                10.0,
            )
            return (per_pair * weights[mine, :, None]).sum(1)
        return moe.expert_parallel_routed(
            x[mine],
            weights[mine],
            chosen[mine],
            dense_experts(w13[held], w2[held], placement),
            10.0,
        )

    out = ranks.run(work)
    whole = grouped_experts(x, weights, chosen, dense_experts(w13, w2), 10.0)
    assert out[1].shape == (0, H)
    torch.testing.assert_close(out[0], whole[rows[0]], rtol=1e-5, atol=1e-5)
