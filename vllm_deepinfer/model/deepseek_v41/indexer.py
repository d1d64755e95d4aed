"""The lightning indexer: scores every compressed position for each query token,
score = sum_h w_h * ReLU(q_h . k), and keeps the top `index_topk`. The candidate source
also publishes its best blocks of `candidate_block_size` positions; later indexers score
only inside them. Layers that are not index sources reuse the latest index source's top-k."""
from __future__ import annotations

import torch
import torch.nn as nn

from vllm_deepinfer.kv_cache.specs import CompressedCaches
from vllm_deepinfer.model.deepseek_v41.args import V41Args
from vllm_deepinfer.model.deepseek_v41.ops import linear, stable_topk, wide
from vllm_deepinfer.model.deepseek_v41.rope import rotate
from vllm_deepinfer.model.deepseek_v41.step import StepBatch


def index_scores(q_idx: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q_idx [T, nI, dI], weights [T, nI], keys [G, dI] -> [T, G]: sum_h w_h relu(q_h . k).
    The torch twin of kernels/indexer_scores.py."""
    s = torch.einsum("thd,gd->thg", wide(q_idx), wide(keys)).relu()
    return (s * wide(weights)[:, :, None]).sum(1)


def candidate_blocks(scores: torch.Tensor, n_visible: torch.Tensor, block_size: int,
                     topk_blocks: int) -> torch.Tensor:
    """Boolean [T, G] mask of positions inside each row's best blocks (block score = max
    visible score); the block holding the newest visible position always qualifies."""
    t, g = scores.shape
    n_blocks = -(-g // block_size)
    positions = torch.arange(g)
    visible = positions[None, :] < n_visible[:, None]
    padded = torch.full((t, n_blocks * block_size), float("-inf"), dtype=wide(scores).dtype)
    padded[:, :g] = wide(scores).masked_fill(~visible, float("-inf"))
    block_score = padded.view(t, n_blocks, block_size).amax(-1)
    newest = ((n_visible - 1).clamp_min(0) // block_size)
    block_score[torch.arange(t), newest] = float("inf")
    chosen = stable_topk(block_score, min(topk_blocks, n_blocks))
    keep = torch.zeros(t, n_blocks, dtype=torch.bool)
    keep.scatter_(1, chosen, torch.gather(block_score, 1, chosen) > float("-inf"))
    return keep[:, positions // block_size] & visible


def select_topk(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean [T, G] selection of the k best allowed positions (all if fewer)."""
    masked = wide(scores).masked_fill(~allowed, float("-inf"))
    chosen = stable_topk(masked, min(k, scores.shape[1]))
    selected = torch.zeros_like(allowed)
    selected.scatter_(1, chosen, True)
    return selected & allowed


def _index_scores(q_idx: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor):
    """The Triton kernel where tensors live on a GPU, the torch twin elsewhere."""
    if q_idx.is_cuda:
        from vllm_deepinfer.kernels.indexer_scores import index_scores as kernel

        return kernel(q_idx, weights, keys)
    return index_scores(q_idx, weights, keys)


class V41Indexer(nn.Module):
    def __init__(self, a: V41Args, layer: int, prefix: str):
        super().__init__()
        self.a, self.layer, self.ratio = a, layer, a.ratio(layer)
        self.wq_b = linear(a.q_lora_rank, a.index_n_heads * a.index_head_dim, f"{prefix}.wq_b")
        self.weights_proj = linear(a.hidden_size, a.index_n_heads, f"{prefix}.weights_proj")

    def select(self, qr: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
               step: StepBatch, caches: CompressedCaches, rope,
               candidates: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Per request, the boolean [chunk, groups] top-k; the candidate source records
        its blocks in `candidates` for the indexers after it."""
        a = self.a
        q = rotate(rope, positions, self.wq_b(qr).view(-1, a.index_n_heads, a.index_head_dim))
        weights = self.weights_proj(x) * (a.index_head_dim * a.index_n_heads) ** -0.5
        md = caches.index_keys.metadata()
        chosen = {}
        for r, rows, _, length in step.requests():
            groups = length // self.ratio
            if groups == 0:
                continue
            keys = caches.index_keys.read(md, r, torch.arange(groups) * self.ratio)
            scores = _index_scores(q[rows], weights[rows], keys)
            n_visible = (positions[rows] + 1) // self.ratio
            allowed = torch.arange(groups)[None, :] < n_visible[:, None]
            if self.layer == a.candidate_source_layer_id:
                candidates[r] = candidate_blocks(
                    scores, n_visible, a.candidate_block_size, a.candidate_topk_blocks)
            if a.reads_candidates(self.layer):
                allowed &= candidates[r]
            chosen[r] = select_topk(scores, allowed, a.index_topk)
        return chosen
