"""Single-latent MLA with sinks: every head attends over one 512-wide latent per key
(key = value), drawn from the layer's own sliding window plus, on compressed layers, the
top-k compressed latents its index source chose. The output gets the inverse RoPE at the
query position and a grouped low-rank projection (`wo_a` per group, then `wo_b`)."""
from __future__ import annotations

import torch
import torch.nn as nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm

from vllm_deepinfer.kv_cache.paged import PagedStepMetadata
from vllm_deepinfer.kv_cache.specs import CompressedCaches, swa_latents
from vllm_deepinfer.model.deepseek_v41.args import V41Args
from vllm_deepinfer.model.deepseek_v41.compressor import V41Compressor
from vllm_deepinfer.model.deepseek_v41.indexer import V41Indexer
from vllm_deepinfer.model.deepseek_v41.ops import linear, wide
from vllm_deepinfer.model.deepseek_v41.rope import make_rope, rotate
from vllm_deepinfer.model.deepseek_v41.step import StepContext


KEY_BUDGET = 1 << 24
"""Most gathered key elements the paged attention holds at once (64 MiB in fp32): long
chunks attend in token tiles."""


def sink_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
                   sink: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, nH, D]; keys [K, D] shared by every query or [T, K, D] per query (value =
    key); mask [T, K]. The per-head sink is one more logit with a zero value, so heads may
    attend to nothing."""
    shared = keys.dim() == 2
    logits = torch.einsum("thd,kd->thk" if shared else "thd,tkd->thk", wide(q),
                          wide(keys)) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink_logits = wide(sink)[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.cat([logits, sink_logits], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("thk,kd->thd" if shared else "thk,tkd->thd", probs,
                        wide(keys)).to(q.dtype)


def grouped_output(o: torch.Tensor, wo_a: torch.Tensor, o_groups: int) -> torch.Tensor:
    """Per-group low-rank output: [T, nH, D] -> [T, o_groups * o_lora_rank]."""
    t = o.shape[0]
    grouped = o.reshape(t, o_groups, -1)
    w = wo_a.view(o_groups, -1, grouped.shape[-1])
    return torch.einsum("tgi,gri->tgr", grouped, w.to(o.dtype)).reshape(t, -1)


class V41Attention(nn.Module):
    def __init__(self, a: V41Args, layer: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self.a, self.layer, self.ratio = a, layer, a.ratio(layer)
        H, D, Q = a.hidden_size, a.head_dim, a.q_lora_rank
        block_size = vllm_config.cache_config.block_size
        dtype = vllm_config.model_config.dtype
        self.wq_a = linear(H, Q, f"{prefix}.wq_a")
        self.wkv = linear(H, D, f"{prefix}.wkv")
        self.q_norm = RMSNorm(Q, eps=a.rms_norm_eps)
        self.kv_norm = RMSNorm(D, eps=a.rms_norm_eps)
        self.wq_b = linear(Q, a.num_attention_heads * D, f"{prefix}.wq_b")
        self.wo_a = nn.Parameter(torch.empty(a.o_groups * a.o_lora_rank,
                                             a.num_attention_heads * D // a.o_groups),
                                 requires_grad=False)
        self.wo_b = linear(a.o_groups * a.o_lora_rank, H, f"{prefix}.wo_b")
        self.attn_sink = nn.Parameter(torch.empty(a.num_attention_heads, dtype=torch.float32),
                                      requires_grad=False)
        self.rope = make_rope(a, self.ratio)
        self.window = swa_latents(prefix, a, block_size, dtype)
        self.is_kv_source = layer in a.kv_source_layer_ids
        self.is_index_source = layer in a.index_source_layer_ids
        if self.is_kv_source:
            self.compressor = V41Compressor(a, layer, f"{prefix}.compressor")
            self.caches = CompressedCaches(a, layer, prefix, block_size, dtype)
        if self.is_index_source:
            self.indexer = V41Indexer(a, layer, f"{prefix}.indexer")

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        a, positions, step = self.a, ctx.positions, ctx.batch
        qr = self.q_norm(self.wq_a(x))
        latent = rotate(self.rope, positions, self.kv_norm(self.wkv(x)))
        q = self.wq_b(qr).view(-1, a.num_attention_heads, a.head_dim)
        q = rotate(self.rope, positions, q)
        out = torch.zeros_like(q)
        window_md = self.window.metadata()
        if step is not None and window_md is not None:
            self.window.write(window_md, window_md.slot_mapping, latent)
            if self.is_kv_source:
                self.compressor.store(x, positions, step, self.caches, self.rope)
            if self.is_index_source:
                ctx.selection[self.layer] = self.indexer.select(
                    qr, x, positions, step, ctx.sources[a.kv_source(self.layer)].caches,
                    self.rope, ctx.candidates)
            key_pos, mask = self._key_positions(ctx)
            tile = max(1, KEY_BUDGET // (key_pos.shape[1] * a.head_dim))
            for first in range(0, q.shape[0], tile):
                rows = slice(first, first + tile)
                keys = self._gather(ctx, window_md, step.request_of_token[rows, None],
                                    key_pos[rows])
                out[rows] = sink_attention(q[rows], keys, mask[rows], self.attn_sink,
                                           a.head_dim ** -0.5)
        out = rotate(self.rope, positions, out, inverse=True)
        return self.wo_b(grouped_output(out, self.wo_a, a.o_groups))

    def _key_positions(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token, the positions of its keys ([T, K]: on compressed layers first the
        index source's top-k groups, then the window) and which of them count."""
        positions = ctx.positions
        window = positions[:, None] - torch.arange(self.a.sliding_window,
                                                   device=positions.device)
        in_window = window >= 0
        window = window.clamp_min(0)
        if not self.ratio:
            return window, in_window
        top = ctx.selection[self.a.index_source(self.layer)]
        compressed = torch.where(top.valid, top.groups, 0) * self.ratio
        return torch.cat([compressed, window], 1), torch.cat([top.valid, in_window], 1)

    def _gather(self, ctx: StepContext, window_md: PagedStepMetadata, requests: torch.Tensor,
                key_pos: torch.Tensor) -> torch.Tensor:
        """[T, K, D] keys of the tokens' requests at key_pos (as `_key_positions` orders)."""
        window = self.window.read(window_md, requests, key_pos[:, -self.a.sliding_window:])
        if not self.ratio:
            return window
        latents = ctx.sources[self.a.kv_source(self.layer)].caches.latents
        compressed = latents.read(latents.metadata(), requests,
                                  key_pos[:, : -self.a.sliding_window])
        return torch.cat([compressed, window], 1)
