"""V4.1's mixture of experts: a sqrtsoftplus router whose fp32 correction bias steers
selection only, weights renormalised and scaled, clamped SwiGLU experts and one shared
expert. Routed experts run in torch: vLLM's CPU fused-MoE kernels offer plain SiLU only
(no clamped SwiGLU) and bf16 only, so FusedMoE cannot run V4.1's experts on the CPU.
Under expert parallelism the tokens of all data-parallel ranks meet at each rank's
experts through vLLM's EP group (its all-to-all manager: all-gather, reduce-scatter);
how the parts split is in parallel.py."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from vllm.config import get_current_vllm_config
from vllm.distributed import (
    get_dp_group,
    get_ep_group,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.distributed.eplb.eplb_state import EplbLayerState
from vllm.forward_context import get_forward_context, is_forward_context_available

from vllm_deepinfer.checkpoint.mx_formats import BLOCK
from vllm_deepinfer.determinism import batch_invariant
from vllm_deepinfer.eplb.load import ExpertLoadBalancing
from vllm_deepinfer.kernels import vllm_kernels, weight_gemv
from vllm_deepinfer.model.deepseek_v41 import layer_ops
from vllm_deepinfer.model.deepseek_v41.args import VISION_ROUTED_IDS, V41Args
from vllm_deepinfer.model.deepseek_v41.layer_ops import register_owner
from vllm_deepinfer.model.deepseek_v41.ops import column_linear, row_linear, stable_topk, wide
from vllm_deepinfer.model.deepseek_v41.parallel import ExpertPlacement
from vllm_deepinfer.model.deepseek_v41.quantization import experts_method
from vllm_deepinfer.model.deepseek_v41.step import StepScope


def route(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
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


def selection_bias(
    bias: torch.Tensor, bias_vl: torch.Tensor | None, vision_routed: torch.Tensor | None
) -> torch.Tensor:
    """[E], or [T, E] where some tokens route as image tokens (bias_vl for those)."""
    if bias_vl is None or vision_routed is None:
        return bias
    return torch.where(vision_routed[:, None], bias_vl[None, :], bias[None, :])


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return batch_invariant.pointwise(F.silu, gate.clamp(max=limit)) * up.clamp(-limit, limit)


class V41Router(nn.Module):
    """Router weight and selection biases: `bias` for text tokens, `bias_vl` (only in the
    vision-language release) for the ids in VISION_ROUTED_IDS. The weight is held in fp32,
    the precision the logits are computed in (the release stores it in bf16, which widens
    exactly), so a bf16 model does not widen it again in every step."""

    def __init__(self, a: V41Args, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(n_experts, a.hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32), requires_grad=False)
        self.bias_vl = (
            nn.Parameter(torch.zeros(n_experts, dtype=torch.float32), requires_grad=False)
            if a.vision_language
            else None
        )

    def selection_bias(self, vision_routed: torch.Tensor | None) -> torch.Tensor:
        return selection_bias(self.bias, self.bias_vl, vision_routed)


class V41Experts(nn.Module):
    """This rank's routed experts: every expert with I' = I / tensor-parallel size, or,
    under expert parallelism, the `placement.local` physical experts this rank holds,
    whole. Stored as the engine's quantization method says (quantization.py): the model
    dtype, or the release's MXFP4 with its scales."""

    def __init__(self, a: V41Args, placement: ExpertPlacement):
        super().__init__()
        self.placement = placement
        i = placement.width.part(a.moe_intermediate_size, "moe_intermediate_size")
        vllm_config = get_current_vllm_config()
        model_config = vllm_config.model_config
        dtype = model_config.dtype if model_config is not None else torch.get_default_dtype()
        self.method = experts_method(vllm_config.quant_config)
        self.method.create_weights(self, placement.local, i, a.hidden_size, dtype)

    @property
    def count(self) -> int:
        return self.placement.local

    def stored(self) -> tuple[torch.Tensor, ...]:
        return self.method.stored(self)

    def project(self, x: torch.Tensor, which: str, expert: int) -> torch.Tensor:
        """x @ W.T for local expert `expert`'s `which` (w13 or w2), read in place."""
        return self.method.apply(self, x, which, expert)

    def load(
        self, expert: int, which: str, tensor: torch.Tensor, scale: torch.Tensor | None
    ) -> bool:
        """Copies checkpoint tensor `which` (w1, w3, w2; with its `.scale` where kept
        quantized) of logical `expert` into every local slot holding it, this rank's share
        of its width; False where none does."""
        slots = [
            slot for slot, held in enumerate(self.placement.initial_logical()) if held == expert
        ]
        for slot in slots:
            self.method.load(self, slot, which, tensor, scale, self.placement.width.rank)
        return bool(slots)


class V41SharedExpert(nn.Module):
    """Split along its intermediate width under tensor parallelism; returns this rank's
    partial sum (the MoE reduces shared and routed parts once)."""

    def __init__(self, a: V41Args, prefix: str):
        super().__init__()
        inter = a.moe_intermediate_size * a.n_shared_experts
        self.w1 = column_linear(a.hidden_size, inter, f"{prefix}.w1", quantized=True)
        self.w3 = column_linear(a.hidden_size, inter, f"{prefix}.w3", quantized=True)
        self.w2 = row_linear(
            inter, a.hidden_size, f"{prefix}.w2", reduce_results=False, quantized=True
        )
        self.limit = a.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class V41MoE(nn.Module):
    def __init__(
        self,
        a: V41Args,
        layer: int,
        prefix: str,
        placement: ExpertPlacement,
        top_k: int | None = None,
    ):
        """`top_k`: the DSpark stages' own count (the backbone's by default)."""
        super().__init__()
        self.a = a
        self.top_k = top_k or a.num_experts_per_tok
        self.placement = placement
        self.gate = V41Router(a, placement.logical)
        fits = not batch_invariant.enabled() and vllm_kernels.router_fits(
            placement.logical, self.top_k
        )
        self.route = vllm_kernels.route if fits else route
        self.experts = V41Experts(a, placement)
        self.shared_experts = V41SharedExpert(a, f"{prefix}.shared_experts")
        self.tensor_parallel = get_tensor_model_parallel_world_size() > 1
        self.balancing = ExpertLoadBalancing()
        self.layer = layer
        self.scope: StepScope | None = None  # the model's (model.py); the backbone only
        self.op_name = register_owner(prefix, self)

    # vLLM's EPLB drives the layer through these (see MixtureOfExperts in model.py).
    @property
    def eplb_state(self) -> EplbLayerState:
        return self.balancing.state

    def get_expert_weights(self) -> tuple[torch.Tensor, ...]:
        """The tensors EPLB moves between ranks, local physical experts first (values and
        scales, as stored)."""
        return self.experts.stored()

    def set_eplb_state(
        self,
        moe_layer_idx: int,
        expert_load_view: torch.Tensor,
        logical_to_physical_map: torch.Tensor,
        logical_replica_count: torch.Tensor,
    ) -> None:
        self.balancing.state.set_layer_state(
            moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count
        )

    def forward(self, x: torch.Tensor, vision_routed: torch.Tensor | None = None) -> torch.Tensor:
        """Router and shared expert in the graph; the routed experts in the layer op
        (`routed_step`)."""
        a = self.a
        logits = batch_invariant.project(x.float(), self.gate.weight)
        bias = self.gate.selection_bias(vision_routed)
        # vLLM's kernel takes one bias for every token: image tokens route with their own.
        router = route if bias.dim() > 1 else self.route
        weights, chosen = router(logits, bias, self.top_k, a.routed_scaling_factor)
        routed = torch.zeros_like(x)
        layer_ops.routed_experts(x, weights, chosen, routed, self.op_name)
        shared = self.shared_experts(x)
        if self.placement.sharded and batch_invariant.enabled():
            # The routed sum is already whole on every rank (expert_parallel_pairs).
            if self.tensor_parallel:
                shared = tensor_model_parallel_all_reduce(shared)
            return shared + routed
        out = shared + routed
        return tensor_model_parallel_all_reduce(out) if self.tensor_parallel else out

    def routed_step(
        self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, out: torch.Tensor
    ) -> None:
        """The layer op (layer_ops.py): this rank's routed-expert sum into `out` for the
        rows the layer computes (the step's real tokens; after decoder-side replay's cut,
        the kept ones; every row of a DSpark stage's blocks, which have no step scope),
        zeros elsewhere. Under data parallelism a rank with no rows still joins the
        collective the other ranks' tokens meet its experts through."""
        rows: torch.Tensor | slice | None = None
        if self.scope is not None:
            ctx, kept = self.scope.rows(self.layer, None)
            if ctx.batch is not None:
                # The real tokens lead the step: a view of them, no gathered copy.
                rows = slice(0, ctx.batch.num_tokens) if kept is None else kept
        if rows is not None:
            x, weights, chosen = x[rows], weights[rows], chosen[rows]
        routed = self._routed(x, weights, chosen)
        if rows is None:
            out.copy_(routed)
        elif isinstance(rows, slice):
            out[rows].copy_(routed)
        else:
            out.index_copy_(0, rows, routed)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        a = self.a
        experts = self.experts
        if not self.placement.sharded:
            if x.shape[0] == 0:
                return x
            if batch_invariant.enabled():
                return fixed_order_experts(x, weights, chosen, experts, a.swiglu_limit)
            stacks = few_pairs_kernel(x, chosen, experts)
            if stacks is not None:
                return weight_gemv.routed_experts(x, chosen, weights, *stacks, a.swiglu_limit)
            return grouped_experts(x, weights, chosen, experts, a.swiglu_limit)
        physical = self.balancing.physical(chosen)
        if batch_invariant.enabled():
            # Each pair's output travels alone (exact: one rank adds it to zeros) and each
            # token sums its k in slot order, wherever its experts live.
            per_pair = expert_parallel_pairs(x, weights, physical, experts, a.swiglu_limit)
            return batch_invariant.weighted_sum(weights.to(x.dtype), per_pair)
        return expert_parallel_routed(x, weights, physical, experts, a.swiglu_limit)


MAX_KERNEL_PAIRS = 64
"""The most (token, slot) pairs the fused C kernel takes: it reads each used expert's rows
once for all its pairs but sums every (row, pair) product on its own, so past a
decode-sized batch the grouped path's batched products cost less (at 64 pairs of the
tiny model the two were within 15% on an AVX-512 machine)."""


def few_pairs_kernel(x: torch.Tensor, chosen: torch.Tensor, experts):
    """The fused kernel's (format, w13, w2) where it runs these experts for this batch
    (kernels/weight_gemv.py: routed_experts): on the CPU, up to MAX_KERNEL_PAIRS pairs, a
    stored format it reads, whole 32-value blocks, the kernel built and turned on."""
    if x.device.type != "cpu" or chosen.numel() > MAX_KERNEL_PAIRS:
        return None
    if not weight_gemv.enabled() or weight_gemv.library() is None:
        return None
    stacks = experts.method.kernel_stacks(experts)
    if stacks is None or x.shape[1] % BLOCK or experts.w2.shape[1] != x.shape[1]:
        return None
    inter = stacks[1][0].shape[1] // 2
    return None if inter % BLOCK else stacks


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


def _per_expert(
    rows: torch.Tensor, counts: list[int], experts: V41Experts, limit: float
) -> torch.Tensor:
    """rows [N, H] sorted by expert (`counts` of each): every used expert's clamped
    SwiGLU on its own rows, its weights read in place (no gathered or cast copy)."""
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            block = rows[start : start + count]
            gate_up = experts.project(block, "w13", expert)
            inter = gate_up.shape[-1] // 2
            act = clamped_swiglu(gate_up[..., :inter], gate_up[..., inter:], limit)
            out[start : start + count] = experts.project(act, "w2", expert)
            start += count
    return out


SMALL_STACK_BYTES = 16 << 20


def _stacked(experts, counts: list[int]) -> bool:
    """Whether one batched product over the whole stack runs the experts: held dense,
    and every expert has rows or the stack is at most SMALL_STACK_BYTES (reading it
    costs less than a call per expert)."""
    small = experts.w13.nbytes + experts.w2.nbytes <= SMALL_STACK_BYTES
    return experts.method.stacked_product and (all(counts) or small)


def _all_experts_at_once(
    rows: torch.Tensor,
    expert: torch.Tensor,
    rank: torch.Tensor,
    busiest: int,
    experts,
    limit: float,
) -> torch.Tensor:
    """rows [N, H] of (token, slot) pairs, each pair's `expert` and `rank` among its
    expert's pairs: one product over the stack, rows padded to the `busiest` count. Rows
    move in and out of the stack by flat row index (index_copy_ / index_select): a
    quarter to a third faster at prefill sizes than indexing by (expert, rank)."""
    w13, w2 = experts.w13, experts.w2
    stack_row = expert * busiest + rank
    padded = rows.new_zeros(w13.shape[0] * busiest, rows.shape[1])
    padded.index_copy_(0, stack_row, rows)
    gate_up = torch.bmm(padded.view(w13.shape[0], busiest, -1), w13.transpose(1, 2))
    inter = w2.shape[2]
    act = clamped_swiglu(gate_up[..., :inter], gate_up[..., inter:], limit)
    out = torch.bmm(act, w2.transpose(1, 2))
    return out.view(-1, out.shape[-1]).index_select(0, stack_row)


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    experts: V41Experts,
    limit: float,
) -> torch.Tensor:
    """The routed experts: (token, slot) pairs sorted by expert, each used expert's rows
    through its weights (one at a time, or all in one product: `_stacked`), outputs
    weighted and summed back per token. x [T, H], weights and chosen [T, k]."""
    t, k = chosen.shape
    order, counts, rank = pairs_by_expert(chosen, experts.count)
    used = counts.tolist()
    token = order // k
    rows = x.index_select(0, token)
    if _stacked(experts, used):
        expert = chosen.flatten()[order]
        routed = _all_experts_at_once(rows, expert, rank, max(used), experts, limit)
    else:
        routed = _per_expert(rows, used, experts, limit)
    routed = routed * weights.flatten()[order, None].to(x.dtype)
    return x.new_zeros(x.shape).index_add_(0, token, routed)


def fixed_order_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    experts: V41Experts,
    limit: float,
) -> torch.Tensor:
    """`grouped_experts` in batch-invariant mode: each expert's rows are cut into tiles
    of ROW_TILE rows (the last one zero-padded; the experts' products run on fixed tiles,
    quantization.py), and each token sums its k weighted outputs in slot order. A
    token's result depends on its own row and routing only."""
    t, k = chosen.shape
    tile = batch_invariant.ROW_TILE
    order, counts, rank = pairs_by_expert(chosen, experts.count)
    padded_counts = (counts + tile - 1) // tile * tile
    # Each sorted pair's slot: its expert's first padded row, then its rank there.
    first_slot = torch.cumsum(padded_counts, 0) - padded_counts
    slot = first_slot[chosen.flatten()[order]] + rank
    tiles = x.new_zeros(int(padded_counts.sum()), x.shape[1])
    tiles[slot] = x[order // k]
    out = _per_expert(tiles, padded_counts.tolist(), experts, limit)
    per_pair = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    per_pair[order] = out[slot]
    return batch_invariant.weighted_sum(weights.to(x.dtype), per_pair.view(t, k, -1))


def _local_pairs(physical: torch.Tensor, placement: ExpertPlacement):
    """(token, slot, local expert) of the pairs whose physical expert this rank holds."""
    local = physical - placement.first
    token, slot = ((local >= 0) & (local < placement.local)).nonzero(as_tuple=True)
    return token, slot, local[token, slot]


class _AcrossDataParallel:
    """The EP group's all-gather of every data-parallel rank's tokens before the routed
    experts and the reduce-scatter of their outputs after (vLLM's all-to-all manager,
    sized by the forward context's per-rank token counts); nothing to move with one
    data-parallel rank.

    Each rank announced its step's token count before the forward (the context's
    `num_tokens_across_dp`), and every rank's collective is sized by those counts. A rank
    may reach the experts with fewer rows than it announced: decoder-side replay computes
    only each request's last `keep` prompt rows after the cut layer (model.py), and the
    runner's padding rows are cut off before the layers. Its rows are padded up to its
    announced count on the way in (zero weights, expert id -1: no rank computes them) and
    cut back on the way out, so the ranks always agree on the sizes."""

    def __enter__(self):
        context = get_forward_context() if is_forward_context_available() else None
        self.dp = context.dp_metadata if context is not None else None
        self.sizes = self.dp.sp_local_sizes(1) if self.dp is not None else None
        self.rows = None
        if self.sizes is not None:
            self.announced = self.sizes.__enter__()[get_dp_group().rank_in_group]
        return self

    def gather(self, *tensors: torch.Tensor):
        if self.dp is None:
            return tensors
        x, weights, ids = tensors
        self.rows = x.shape[0]
        missing = self.announced - self.rows
        if missing < 0:
            raise RuntimeError(
                f"{self.rows} rows reach the experts on a data-parallel rank "
                f"that announced {self.announced}"
            )
        if missing:
            x = torch.cat([x, x.new_zeros(missing, *x.shape[1:])])
            weights = torch.cat([weights, weights.new_zeros(missing, *weights.shape[1:])])
            ids = torch.cat([ids, ids.new_full((missing, *ids.shape[1:]), -1)])
        x, weights, ids = get_ep_group().dispatch(x, weights, ids)
        return x, weights, ids

    def scatter(self, out: torch.Tensor) -> torch.Tensor:
        if self.dp is None:
            return out
        return get_ep_group().combine(out)[: self.rows]

    def __exit__(self, *exc):
        if self.sizes is not None:
            self.sizes.__exit__(*exc)


def expert_parallel_routed(
    x: torch.Tensor,
    weights: torch.Tensor,
    physical: torch.Tensor,
    experts: V41Experts,
    limit: float,
) -> torch.Tensor:
    """This rank's part of the routed experts' weighted sum for its own tokens: every
    data-parallel rank's tokens are gathered, the pairs whose expert lives here computed,
    and the partial sums reduce-scattered back."""
    with _AcrossDataParallel() as across:
        x_all, weights_all, physical_all = across.gather(x, weights, physical)
        token, slot, local = _local_pairs(physical_all, experts.placement)
        out = x_all.new_zeros(x_all.shape)
        if token.numel():
            routed = grouped_experts(
                x_all[token], weights_all[token, slot, None], local[:, None], experts, limit
            )
            out.index_add_(0, token, routed)
        return across.scatter(out)


def expert_parallel_pairs(
    x: torch.Tensor,
    weights: torch.Tensor,
    physical: torch.Tensor,
    experts: V41Experts,
    limit: float,
) -> torch.Tensor:
    """[T, k, H]: each of this rank's (token, slot) pairs' unweighted expert output,
    batch-invariant: pairs computed in fixed tiles where their expert lives, zeros
    elsewhere, summed over the EP group (one value and zeros: exact)."""
    with _AcrossDataParallel() as across:
        x_all, _, physical_all = across.gather(x, weights, physical)
        token, slot, local = _local_pairs(physical_all, experts.placement)
        per_pair = x_all.new_zeros(*physical_all.shape, x_all.shape[1])
        if token.numel():
            per_pair[token, slot] = fixed_order_experts(
                x_all[token],
                torch.ones(token.numel(), 1, dtype=x.dtype),
                local[:, None],
                experts,
                limit,
            )
        pairs = across.scatter(per_pair.flatten(1))
        if get_tensor_model_parallel_world_size() > 1:  # the EP group's other dimension
            pairs = tensor_model_parallel_all_reduce(pairs)
        return pairs.view(*physical.shape, x.shape[1])
