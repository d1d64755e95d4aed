"""V4.1's mixture of experts: a sqrtsoftplus router whose fp32 correction bias steers
selection only, weights renormalised and scaled, clamped SwiGLU experts and one shared
expert. Routed experts run in torch: vLLM's CPU fused-MoE kernels offer plain SiLU only
(no clamped SwiGLU) and bf16 only, so FusedMoE cannot run V4.1's experts on the CPU."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_deepinfer.determinism import batch_invariant
from vllm_deepinfer.model.deepseek_v41.args import VISION_ROUTED_IDS, V41Args
from vllm_deepinfer.model.deepseek_v41.ops import linear, stable_topk, wide


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """sqrtsoftplus scores; the bias ([E], or [T, E] per token) steers selection only;
    weights renormalised x scaling."""
    scores = torch.sqrt(batch_invariant.pointwise(F.softplus, wide(logits)))
    chosen = stable_topk(scores + wide(bias), top_k)
    weights = torch.gather(scores, 1, chosen)
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20) * scaling
    return weights, chosen


def routed_as_image(token_ids: torch.Tensor) -> torch.Tensor:
    """bool [T]: the tokens the vision-language MoE routes with `bias_vl`."""
    return (token_ids >= VISION_ROUTED_IDS.start) & (token_ids < VISION_ROUTED_IDS.stop)


def selection_bias(bias: torch.Tensor, bias_vl: torch.Tensor | None,
                   vision_routed: torch.Tensor | None) -> torch.Tensor:
    """[E], or [T, E] where some tokens route as image tokens (bias_vl for those)."""
    if bias_vl is None or vision_routed is None or not bool(vision_routed.any()):
        return bias
    return torch.where(vision_routed[:, None], bias_vl[None, :], bias[None, :])


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return batch_invariant.pointwise(F.silu, gate.clamp(max=limit)) * up.clamp(-limit, limit)


class V41Router(nn.Module):
    """Router weight and selection biases: `bias` for text tokens, `bias_vl` (only in the
    vision-language release) for the ids in VISION_ROUTED_IDS."""

    def __init__(self, a: V41Args, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, a.hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32),
                                 requires_grad=False)
        self.bias_vl = (nn.Parameter(torch.zeros(n_experts, dtype=torch.float32),
                                     requires_grad=False) if a.vision_language else None)

    def selection_bias(self, vision_routed: torch.Tensor | None) -> torch.Tensor:
        return selection_bias(self.bias, self.bias_vl, vision_routed)


class V41Experts(nn.Module):
    """Routed experts stacked as [E, 2I, H] (w1 rows, then w3) and [E, H, I]."""

    def __init__(self, a: V41Args, n_experts: int):
        super().__init__()
        i, h = a.moe_intermediate_size, a.hidden_size
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n_experts, h, i), requires_grad=False)


class V41SharedExpert(nn.Module):
    def __init__(self, a: V41Args, prefix: str):
        super().__init__()
        inter = a.moe_intermediate_size * a.n_shared_experts
        self.w1 = linear(a.hidden_size, inter, f"{prefix}.w1")
        self.w3 = linear(a.hidden_size, inter, f"{prefix}.w3")
        self.w2 = linear(inter, a.hidden_size, f"{prefix}.w2")
        self.limit = a.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class V41MoE(nn.Module):
    def __init__(self, a: V41Args, prefix: str, n_experts: int | None = None,
                 top_k: int | None = None):
        """`n_experts`/`top_k`: the DSpark stages' own counts (the backbone's by default)."""
        super().__init__()
        self.a = a
        self.top_k = top_k or a.num_experts_per_tok
        self.gate = V41Router(a, n_experts or a.n_routed_experts)
        self.experts = V41Experts(a, n_experts or a.n_routed_experts)
        self.shared_experts = V41SharedExpert(a, f"{prefix}.shared_experts")

    def forward(self, x: torch.Tensor, vision_routed: torch.Tensor | None = None) -> torch.Tensor:
        a = self.a
        logits = batch_invariant.project(x.float(), self.gate.weight.float())
        weights, chosen = route(logits, self.gate.selection_bias(vision_routed),
                                self.top_k, a.routed_scaling_factor)
        experts = fixed_order_experts if batch_invariant.enabled() else grouped_experts
        return self.shared_experts(x) + experts(
            x, weights, chosen, self.experts.w13, self.experts.w2, a.swiglu_limit)


def pairs_by_expert(chosen: torch.Tensor, n_experts: int):
    """The (token, slot) pairs of `chosen` [T, k] sorted by expert (stable): the order
    (flat pair indices), each expert's pair count, and each sorted pair's rank within its
    expert."""
    expert = chosen.flatten()
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=n_experts)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.numel(), device=chosen.device) - first[expert[order]]
    return order, counts, rank


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """The routed experts as one grouped computation: (token, slot) pairs sorted by expert,
    each used expert's rows padded to the busiest one's count, two batched matmuls with
    the clamped SwiGLU between, outputs weighted and summed back per token.
    x [T, H], weights and chosen [T, k], w13 [E, 2I, H], w2 [E, H, I]."""
    t, k = chosen.shape
    order, counts, row = pairs_by_expert(chosen, w13.shape[0])  # row in its expert's block
    used = counts.nonzero().flatten()
    block = torch.searchsorted(used, chosen.flatten()[order])
    padded = x.new_zeros(used.numel(), int(counts.max()), x.shape[1])
    padded[block, row] = x[order // k]
    if used.numel() < w13.shape[0]:
        w13, w2 = w13[used], w2[used]
    gate_up = torch.bmm(padded, w13.transpose(1, 2).to(x.dtype))
    inter = w2.shape[2]
    act = clamped_swiglu(gate_up[..., :inter], gate_up[..., inter:], limit)
    routed = torch.bmm(act, w2.transpose(1, 2).to(x.dtype))[block, row]
    routed = routed * weights.flatten()[order, None].to(x.dtype)
    return x.new_zeros(x.shape).index_add_(0, order // k, routed)


def fixed_order_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                        w13: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """`grouped_experts` in batch-invariant mode: each expert's rows are cut into tiles
    of ROW_TILE rows (the last one zero-padded), every tile runs as one fixed-shape
    product with its expert's weights, and each token sums its k weighted outputs in
    slot order. A token's result depends on its own row and routing only."""
    t, k = chosen.shape
    tile = batch_invariant.ROW_TILE
    order, counts, rank = pairs_by_expert(chosen, w13.shape[0])
    tiles_per_expert = (counts + tile - 1) // tile
    tile_expert = torch.repeat_interleave(torch.arange(w13.shape[0], device=x.device),
                                          tiles_per_expert)
    # Each sorted pair's slot: its expert's first tile, then its rank within the expert.
    first_slot = (torch.cumsum(tiles_per_expert, 0) - tiles_per_expert) * tile
    slot = first_slot[chosen.flatten()[order]] + rank
    tiles = x.new_zeros(tile_expert.numel() * tile, x.shape[1])
    tiles[slot] = x[order // k]
    tiles = tiles.view(-1, tile, x.shape[1])
    # Gathered from the transposed views: one copy, already in the layout bmm takes.
    gate_up = batch_invariant.bmm(tiles, w13.transpose(1, 2)[tile_expert].to(x.dtype))
    inter = w2.shape[2]
    act = clamped_swiglu(gate_up[..., :inter], gate_up[..., inter:], limit)
    out = batch_invariant.bmm(act, w2.transpose(1, 2)[tile_expert].to(x.dtype))
    per_pair = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    per_pair[order] = out.flatten(0, 1)[slot]
    return batch_invariant.weighted_sum(weights.to(x.dtype), per_pair.view(t, k, -1))
