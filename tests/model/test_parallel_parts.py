"""How V4.1's routed experts split, checked without processes: every rank's share of the
experts (or of their width) sums to the whole layer's output, and the checkpoint loads
into the slots vLLM's initial EPLB placement gives each rank."""
import pytest
import torch

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
    whole = grouped_experts(x, weights, chosen, w13, w2, 10.0)
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
        total += expert_parallel_routed(x, weights, physical, placement, w13[held],
                                        w2[held], 10.0)
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_widths_sum_to_the_whole_layer(layer):
    x, weights, chosen, w13, w2 = layer
    whole = grouped_experts(x, weights, chosen, w13, w2, 10.0)
    half = I // 2
    total = sum(grouped_experts(
        x, weights, chosen,
        torch.cat([w13[:, r * half:(r + 1) * half], w13[:, I + r * half:I + (r + 1) * half]], 1),
        w2[:, :, r * half:(r + 1) * half], 10.0) for r in range(2))
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def test_placement_follows_vllms_initial_map():
    placement = ExpertPlacement(8, 10, 2, 1, TensorSplit(1, 0))
    assert (placement.local, placement.first) == (5, 5)
    assert placement.initial_logical() == [5, 6, 7, 0, 1]  # slots 8, 9: copies of 0, 1
    with pytest.raises(ValueError, match="does not split"):
        TensorSplit(3, 0).part(8, "o_groups")


def test_experts_load_this_ranks_share():
    from vllm_deepinfer.model.deepseek_v41.moe import V41Experts

    a = type("Args", (), {"moe_intermediate_size": I, "hidden_size": H})()
    experts = V41Experts(a, ExpertPlacement(8, 10, 2, 1, TensorSplit(1, 0)))
    w1, w3, w2 = torch.randn(I, H), torch.randn(I, H), torch.randn(H, I)
    assert experts.load(0, "w1", w1) and experts.load(0, "w3", w3) and experts.load(0, "w2", w2)
    torch.testing.assert_close(experts.w13.data[3], torch.cat([w1, w3]))  # slot 8 = expert 0
    torch.testing.assert_close(experts.w2.data[3], w2)
    assert not experts.load(2, "w1", w1)  # expert 2 lives on rank 0 only
    width = V41Experts(a, ExpertPlacement(8, 8, 1, 0, TensorSplit(2, 1)))
    width.load(4, "w1", w1)
    width.load(4, "w2", w2)
    torch.testing.assert_close(width.w13.data[4, :I // 2], w1[I // 2:])
    torch.testing.assert_close(width.w2.data[4], w2[:, I // 2:])
