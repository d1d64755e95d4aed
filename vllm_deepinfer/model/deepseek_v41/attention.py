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


def sink_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
                   sink: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, nH, D], keys [K, D] (value = key), mask [T, K]; the per-head sink is one more
    logit with a zero value, so heads may attend to nothing."""
    logits = torch.einsum("thd,kd->thk", wide(q), wide(keys)) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink_logits = wide(sink)[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.cat([logits, sink_logits], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("thk,kd->thd", probs, wide(keys)).to(q.dtype)


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
            source = ctx.sources[a.kv_source(self.layer)] if self.ratio else None
            if self.is_index_source:
                ctx.selection[self.layer] = self.indexer.select(
                    qr, x, positions, step, source.caches, self.rope, ctx.candidates)
            for r, rows, start, length in step.requests():
                keys, mask = self._window_keys(window_md, r, positions[rows], start, length)
                if self.ratio and length // self.ratio:
                    groups = torch.arange(length // self.ratio) * self.ratio
                    caches = source.caches
                    compressed = caches.latents.read(caches.latents.metadata(), r, groups)
                    keys = torch.cat([compressed, keys])
                    selected = ctx.selection[a.index_source(self.layer)][r]
                    mask = torch.cat([selected, mask], dim=1)
                out[rows] = sink_attention(q[rows], keys, mask, self.attn_sink,
                                           a.head_dim ** -0.5)
        out = rotate(self.rope, positions, out, inverse=True)
        return self.wo_b(grouped_output(out, self.wo_a, a.o_groups))

    def _window_keys(self, md: PagedStepMetadata, r: int, query_pos: torch.Tensor, start: int,
                     length: int):
        """This layer's own latents in the window of any query of the chunk."""
        key_pos = torch.arange(max(0, start - self.a.sliding_window + 1), length)
        keys = self.window.read(md, r, key_pos)
        mask = ((key_pos[None, :] <= query_pos[:, None])
                & (key_pos[None, :] > query_pos[:, None] - self.a.sliding_window))
        return keys, mask
