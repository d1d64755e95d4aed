"""The lightning indexer: scores every compressed position for each query token,
score = sum_h w_h * ReLU(q_h . k), and keeps the top `index_topk`. The candidate source
also publishes its best blocks of `candidate_block_size` positions; later indexers score
only inside them. Layers that are not index sources reuse the latest index source's top-k."""

from __future__ import annotations

import torch
import torch.nn as nn

from vllm_deepinfer.determinism import batch_invariant
from vllm_deepinfer.kernels import index_topk, sparse_attention
from vllm_deepinfer.kv_cache.specs import CompressedCaches
from vllm_deepinfer.model.deepseek_v41.args import V41Args
from vllm_deepinfer.model.deepseek_v41.ops import linear, stable_topk, wide
from vllm_deepinfer.model.deepseek_v41.rope import rotate
from vllm_deepinfer.model.deepseek_v41.step import StepBatch, TopK

KEY_TILE = 64
"""Compressed positions scored per batched product in batch-invariant mode: a position's
score is computed in the same tile shape whatever the context's length."""

SCORE_BUDGET = 1 << 24
"""Most [.., nI, G] intermediate elements the torch scores make at once (64 MiB in fp32):
long chunks are scored in query tiles."""


def index_scores(q_idx: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q_idx [..., T, nI, dI], weights [..., T, nI], keys [..., G, dI] -> [..., T, G]:
    sum_h w_h relu(q_h . k), the leading dimension (if any) being the request. The torch
    twin of kernels/indexer_scores.py."""
    s = torch.einsum("...thd,...gd->...thg", wide(q_idx), wide(keys)).relu()
    return (s * wide(weights)[..., None]).sum(-2)


def candidate_blocks(
    scores: torch.Tensor, n_visible: torch.Tensor, block_size: int, topk_blocks: int
) -> torch.Tensor:
    """Boolean [T, G] mask of positions inside each row's best blocks (block score = max
    visible score); the block holding the newest visible position always qualifies."""
    t, g = scores.shape
    device = scores.device
    n_blocks = -(-g // block_size)
    positions = torch.arange(g, device=device)
    visible = positions[None, :] < n_visible[:, None]
    padded = torch.full(
        (t, n_blocks * block_size), float("-inf"), dtype=wide(scores).dtype, device=device
    )
    padded[:, :g] = wide(scores).masked_fill(~visible, float("-inf"))
    block_score = padded.view(t, n_blocks, block_size).amax(-1)
    newest = (n_visible - 1).clamp_min(0) // block_size
    block_score[torch.arange(t, device=device), newest] = float("inf")
    chosen = stable_topk(block_score, min(topk_blocks, n_blocks))
    keep = torch.zeros(t, n_blocks, dtype=torch.bool, device=device)
    keep.scatter_(1, chosen, torch.gather(block_score, 1, chosen) > float("-inf"))
    return keep[:, positions // block_size] & visible


def topk_groups(
    scores: torch.Tensor, allowed: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best allowed positions of each row [T, G]: indices [T, min(k, G)] and which of
    them are allowed (fewer than k allowed leaves the rest invalid)."""
    masked = wide(scores).masked_fill(~allowed, float("-inf"))
    chosen = stable_topk(masked, min(k, scores.shape[1]))
    return chosen, torch.gather(allowed, 1, chosen)


def select_topk(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean [T, G] selection of the k best allowed positions (all if fewer)."""
    chosen, valid = topk_groups(scores, allowed, k)
    return torch.zeros_like(allowed).scatter_(1, chosen, valid)


def fixed_order_index_scores(
    q_idx: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """`index_scores` of padded request groups in batch-invariant mode: q_idx [R, Q, nI,
    dI], weights [R, Q, nI], keys [R, G, dI] -> [R, Q, G]. Each (query, head) row meets
    KEY_TILE keys at a time in fixed-tile products and the heads are summed in order, so
    a score depends on its query and key only (not on Q, G or the batch)."""
    r, q, n_heads, d = q_idx.shape
    g = keys.shape[1]
    padded = keys.new_zeros(r, -(-g // KEY_TILE) * KEY_TILE, d)
    padded[:, :g] = keys
    dots = torch.empty(r, q, n_heads, padded.shape[1], dtype=wide(keys).dtype, device=keys.device)
    for request in range(r):
        rows = wide(q_idx[request]).reshape(q * n_heads, d)
        for k0 in range(0, padded.shape[1], KEY_TILE):
            tile = wide(padded[request, k0 : k0 + KEY_TILE])
            dots[request, ..., k0 : k0 + KEY_TILE] = batch_invariant.linear(rows, tile).view(
                q, n_heads, KEY_TILE
            )
    return batch_invariant.weighted_sum(wide(weights), dots[..., :g].relu())


def _index_scores(q_idx: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor):
    """[R, Q, G] scores of padded request groups: the Triton kernel where tensors live on
    a GPU, the torch twin elsewhere, in query tiles that bound its intermediate; in
    batch-invariant mode the fixed-order scores."""
    if batch_invariant.enabled():
        return fixed_order_index_scores(q_idx, weights, keys)
    if q_idx.is_cuda:
        from vllm_deepinfer.kernels.indexer_scores import index_scores as kernel

        return kernel(q_idx, weights, keys)
    r, q, n_heads, _ = q_idx.shape
    tile = max(1, SCORE_BUDGET // max(1, r * n_heads * keys.shape[1]))
    return torch.cat(
        [
            index_scores(q_idx[:, i : i + tile], weights[:, i : i + tile], keys)
            for i in range(0, q, tile)
        ],
        dim=1,
    )


class V41Indexer(nn.Module):
    def __init__(self, a: V41Args, layer: int, prefix: str):
        super().__init__()
        self.a, self.layer, self.ratio = a, layer, a.ratio(layer)
        self.wq_b = linear(
            a.q_lora_rank, a.index_n_heads * a.index_head_dim, f"{prefix}.wq_b", quantized=True
        )
        self.weights_proj = linear(a.hidden_size, a.index_n_heads, f"{prefix}.weights_proj")

    def queries(
        self, qr: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's RoPE'd queries [T, nI, dI] and head weights [T, nI]."""
        a = self.a
        q = rotate(rope, positions, self.wq_b(qr).view(-1, a.index_n_heads, a.index_head_dim))
        return q, self.weights_proj(x) * (a.index_head_dim * a.index_n_heads) ** -0.5

    def select(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        positions: torch.Tensor,
        step: StepBatch,
        caches: CompressedCaches,
        candidates: dict[int, torch.Tensor],
    ) -> TopK:
        """Every token's top-k compressed groups, scored per padded request group against
        that request's index keys; the candidate source records each group's blocks in
        `candidates` for the indexers after it."""
        a = self.a
        md = caches.index_keys.metadata()
        chosen = positions.new_zeros(positions.shape[0], a.index_topk)
        valid = torch.zeros_like(chosen, dtype=torch.bool)
        for number, group in enumerate(step.groups):
            n_groups = int(group.seq_lens.max()) // self.ratio
            if n_groups == 0:
                continue
            group_ids = torch.arange(n_groups, device=positions.device)
            rows = group.tokens.clamp_min(0)
            n_visible = torch.where(group.present, (positions[rows] + 1) // self.ratio, 0).flatten()
            if self._kernel_reads(caches, q):
                scores = sparse_attention.index_scores(
                    q,
                    weights,
                    rows.flatten(),
                    group.requests[:, None].expand(rows.shape).flatten(),
                    n_visible,
                    n_groups,
                    sparse_attention.cache_view(caches.index_keys, md),
                    self.ratio,
                )
            else:
                key_pos = torch.minimum(
                    group_ids[None, :] * self.ratio, group.seq_lens[:, None] - 1
                )
                keys = caches.index_keys.read(md, group.requests[:, None], key_pos)
                scores = _index_scores(q[rows], weights[rows], keys).flatten(0, 1)
            in_c = index_topk.fits(scores)  # the C kernel chooses as the torch twins do
            if self.layer == a.candidate_source_layer_id:
                blocks_of = index_topk.candidate_blocks if in_c else candidate_blocks
                candidates[number] = blocks_of(
                    scores, n_visible, a.candidate_block_size, a.candidate_topk_blocks
                )
            in_blocks = candidates[number] if a.reads_candidates(self.layer) else None
            if in_c:
                index_topk.select_into(
                    scores,
                    n_visible,
                    in_blocks,
                    a.index_topk,
                    group.tokens.flatten(),
                    chosen,
                    valid,
                )
                continue
            allowed = group_ids[None, :] < n_visible[:, None]
            if in_blocks is not None:
                allowed &= in_blocks
            top, ok = topk_groups(scores, allowed, a.index_topk)
            present = group.present.flatten()
            tokens = group.tokens.flatten()[present]
            chosen[tokens, : top.shape[1]] = top[present]
            valid[tokens, : top.shape[1]] = ok[present]
        return TopK(chosen, valid)

    @staticmethod
    def _kernel_reads(caches: CompressedCaches, q: torch.Tensor) -> bool:
        """Whether the C kernel scores from these index keys in place: on the CPU, outside
        batch-invariant mode, keys in the model dtype (fp32 or bf16, not fp8 records)."""
        return (
            q.device.type == "cpu"
            and not batch_invariant.enabled()
            and sparse_attention.usable()
            and sparse_attention.reads_cache(caches.index_keys)
        )
