"""The compressor of a kv source: pools `ratio` tokens into one latent (ratio 2: a
per-dimension softmax over the pair's gate scores weighs their `wkv` rows), RMSNorms it,
derives the lightning indexer's key from it, and RoPEs both at the group's start. It runs
in fp32; a ratio-2 group closes at an odd position and its first row may come from an
earlier step, so the open group waits in a paged state cache."""

from __future__ import annotations

import torch
import torch.nn as nn

from vllm_deepinfer.determinism import batch_invariant
from vllm_deepinfer.kv_cache.specs import CompressedCaches
from vllm_deepinfer.model.deepseek_v41.args import V41Args
from vllm_deepinfer.model.deepseek_v41.ops import linear, rms_norm
from vllm_deepinfer.model.deepseek_v41.rope import rotate
from vllm_deepinfer.model.deepseek_v41.step import StepBatch


def pool_pair(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Ratio-2 group: per-dimension softmax over the two tokens' scores. kv, score: [2, G, D].
    In batch-invariant mode each pair is one softmax row (a softmax over dim 0 vectorizes
    across the step's groups, with a scalar tail wherever their count puts it)."""
    if batch_invariant.enabled():
        weights = score.permute(1, 2, 0).contiguous().softmax(-1).permute(2, 0, 1)
        return kv[0] * weights[0] + kv[1] * weights[1]
    return (kv * score.softmax(0)).sum(0)


class V41Compressor(nn.Module):
    """Split around the attention op: `project` runs in the compiled graph, `store` in the
    op. Ratio 1 finishes its rows in the graph; ratio 2 pools with a partner row that may
    be an earlier step's, so only its projection runs there."""

    def __init__(self, a: V41Args, layer: int, prefix: str):
        super().__init__()
        self.a, self.ratio = a, a.ratio(layer)
        # wkv and (ratio 2) wgate read the same input: one product, the checkpoint's two
        # tensors in its row halves (COMPRESSOR_ROWS, model.py's load_weights).
        width = a.head_dim * (2 if self.ratio == 2 else 1)
        self.wkv_gate = linear(a.hidden_size, width, f"{prefix}.wkv_gate", torch.float32)
        self.norm = nn.Parameter(torch.ones(a.head_dim, dtype=torch.float32), requires_grad=False)
        self.wk = linear(a.head_dim, a.index_head_dim, f"{prefix}.wk")
        self.k_norm = nn.Parameter(
            torch.ones(a.index_head_dim, dtype=torch.float32), requires_grad=False
        )

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, rope
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the op's `store` takes for x [T, H]: ratio 2, the pair inputs [T, 2D] (kv
        rows, then gate scores; fp32) and None; ratio 1, every token's finished rows."""
        raw = self.wkv_gate(x.float())
        if self.ratio == 2:
            return raw, None
        return self._finish(raw, positions, rope)

    def _finish(
        self, pooled: torch.Tensor, start: torch.Tensor, rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled groups -> (latent [G, D] fp32, index key [G, dI]), RoPE'd at the groups'
        start positions."""
        latent = rms_norm(pooled, self.norm, self.a.rms_norm_eps)
        index_keys = rms_norm(
            self.wk(latent.to(self.wk.weight.dtype)), self.k_norm, self.a.rms_norm_eps
        )
        return rotate(rope, start, latent), rotate(rope, start, index_keys)

    def store(
        self,
        rows: torch.Tensor,
        index_keys: torch.Tensor | None,
        positions: torch.Tensor,
        step: StepBatch,
        caches: CompressedCaches,
        rope,
    ) -> None:
        """Writes the groups this step closes, from `project`'s output for its tokens."""
        if self.ratio == 1:
            closing = slice(None)
            latent = rows
        else:
            state_md = caches.open_group.metadata()
            caches.open_group.write(state_md, state_md.slot_mapping, rows)
            # A group closes at an odd position; its first row may be an earlier step's.
            closing = (positions % 2 == 1).nonzero().flatten()
            if closing.numel() == 0:
                return
            previous = caches.open_group.read(
                state_md, step.request_of_token[closing], positions[closing] - 1
            )
            current = rows[closing]
            d = self.a.head_dim
            pooled = pool_pair(
                torch.stack([previous[:, :d], current[:, :d]]),
                torch.stack([previous[:, d:], current[:, d:]]),
            )
            latent, index_keys = self._finish(pooled, positions[closing] - 1, rope)
        for cache, values in ((caches.latents, latent), (caches.index_keys, index_keys)):
            md = cache.metadata()
            cache.write(md, md.slot_mapping[closing], values)
