"""DeepSeek V4.1-Flash for vLLM, portable: plain torch on vLLM's layers and KV cache manager.

Attention → MoE → DecoderLayer (with hyper-connections and Engram) → Model → ForCausalLM.
Every cache V4.1 keeps is paged by vLLM (see kv_cache.paged); attention gathers its keys
per request from those caches, so chunked prefill, mixed batches, preemption and prefix
caching work as for any vLLM model.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.nn as nn
from tokenizers import Tokenizer
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                 VocabParallelEmbedding)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

from vllm_deepinfer.kv_cache.paged import PagedCache, PagedStepMetadata
from vllm_deepinfer.model import ops
from vllm_deepinfer.model.args import V41Args
from vllm_deepinfer.model.checkpoint_format import checked
from vllm_deepinfer.model.engram import NO_TOKEN, EngramHashing, compressed_vocabulary
from vllm_deepinfer.model.layout import backbone_layout


def _linear(in_features: int, out_features: int, prefix: str,
            dtype: torch.dtype | None = None) -> ReplicatedLinear:
    return ReplicatedLinear(in_features, out_features, bias=False, params_dtype=dtype,
                            prefix=prefix, return_bias=False)


def _rope(a: V41Args, ratio: int):
    """vLLM's DeepSeek V4 rotary: last qk_rope_head_dim dims, interleaved, no mscale."""
    scaling = ops.layer_rope_scaling(a.rope_scaling, ratio)
    params = {"rope_type": "deepseek_yarn", "mscale": 0, "mscale_all_dim": 0,
              "is_deepseek_v4": True, "rope_dim": a.qk_rope_head_dim,
              "rope_theta": a.compress_rope_theta if ratio else a.rope_theta}
    if scaling is None:
        params.update(factor=1.0, original_max_position_embeddings=a.max_position_embeddings)
    else:
        params.update(factor=scaling["factor"], beta_fast=scaling.get("beta_fast", 32),
                      beta_slow=scaling.get("beta_slow", 1),
                      original_max_position_embeddings=scaling["original_max_position_embeddings"])
    return get_rope(a.head_dim, max_position=a.max_position_embeddings, rope_parameters=params,
                    is_neox_style=False, dtype=torch.float32)


def _rotate(rope, positions: torch.Tensor, x: torch.Tensor, inverse: bool = False):
    """Rotates x [T, D] or [T, heads, D] at its own positions."""
    rows = x if x.dim() == 3 else x[:, None, :]
    rotated, _ = rope.forward_native(positions, rows, None, inverse=inverse)
    return rotated.view_as(x)


@dataclass
class StepBatch:
    """The requests of one forward step: token ranges and context lengths."""
    query_start: list[int]
    seq_lens: list[int]
    num_tokens: int

    @classmethod
    def from_metadata(cls, md: PagedStepMetadata | None) -> "StepBatch | None":
        if md is None:
            return None
        return cls(md.query_start_loc, md.seq_lens, md.num_actual_tokens)

    def requests(self):
        """(request index, token slice, first position of the chunk, context length)."""
        for r, length in enumerate(self.seq_lens):
            qs, qe = self.query_start[r], self.query_start[r + 1]
            if qe > qs:
                yield r, slice(qs, qe), length - (qe - qs), length


@dataclass
class CrossLayerState:
    """What later layers reuse within one step: top-k of each index source and the
    candidate blocks, per request."""
    selection: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)


class CompressedCaches(nn.Module):
    """A kv source's compressed latents and index keys (one row per `ratio` tokens), and
    for ratio 2 the fp32 [kv | score] rows of the still-open group."""

    def __init__(self, a: V41Args, layer: int, prefix: str, block_size: int, dtype):
        super().__init__()
        ratio = a.ratio(layer)
        self.latents = PagedCache(f"{prefix}.compressed_kv", MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=a.head_dim, dtype=dtype,
            tokens_per_state=ratio))
        self.index_keys = PagedCache(f"{prefix}.index_k", MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=a.index_head_dim, dtype=dtype,
            tokens_per_state=ratio))
        self.open_group = None
        if ratio == 2:
            self.open_group = PagedCache(f"{prefix}.compressor_state", SlidingWindowMLASpec(
                block_size=block_size, num_kv_heads=1, head_size=2 * a.head_dim,
                dtype=torch.float32, sliding_window=ratio))


class V41Attention(nn.Module):
    """Single-latent MLA with sinks over a sliding window plus top-k compressed latents."""

    def __init__(self, a: V41Args, layer: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self.a, self.layer, self.ratio = a, layer, a.ratio(layer)
        H, D, Q = a.hidden_size, a.head_dim, a.q_lora_rank
        block_size = vllm_config.cache_config.block_size
        dtype = vllm_config.model_config.dtype
        self.wq_a = _linear(H, Q, f"{prefix}.wq_a")
        self.wkv = _linear(H, D, f"{prefix}.wkv")
        self.q_norm = RMSNorm(Q, eps=a.rms_norm_eps)
        self.kv_norm = RMSNorm(D, eps=a.rms_norm_eps)
        self.wq_b = _linear(Q, a.num_attention_heads * D, f"{prefix}.wq_b")
        self.wo_a = nn.Parameter(torch.empty(a.o_groups * a.o_lora_rank,
                                             a.num_attention_heads * D // a.o_groups),
                                 requires_grad=False)
        self.wo_b = _linear(a.o_groups * a.o_lora_rank, H, f"{prefix}.wo_b")
        self.attn_sink = nn.Parameter(torch.empty(a.num_attention_heads, dtype=torch.float32),
                                      requires_grad=False)
        self.rope = _rope(a, self.ratio)
        self.window = PagedCache(f"{prefix}.swa_kv", SlidingWindowMLASpec(
            block_size=block_size, num_kv_heads=1, head_size=D, dtype=dtype,
            sliding_window=a.sliding_window))
        self.is_kv_source = layer in a.kv_source_layer_ids
        self.is_index_source = layer in a.index_source_layer_ids
        if self.is_kv_source:
            self.compressor = V41Compressor(a, layer, f"{prefix}.compressor")
            self.caches = CompressedCaches(a, layer, prefix, block_size, dtype)
        if self.is_index_source:
            self.indexer = V41Indexer(a, layer, f"{prefix}.indexer")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, step: StepBatch | None,
                sources: dict[int, "V41Attention"], state: CrossLayerState) -> torch.Tensor:
        a = self.a
        qr = self.q_norm(self.wq_a(x))
        latent = _rotate(self.rope, positions, self.kv_norm(self.wkv(x)))
        q = self.wq_b(qr).view(-1, a.num_attention_heads, a.head_dim)
        q = _rotate(self.rope, positions, q)
        out = torch.zeros_like(q)
        window_md = self.window.metadata()
        if step is not None and window_md is not None:
            self.window.write(window_md, window_md.slot_mapping, latent)
            if self.is_kv_source:
                self.compressor.store(x, positions, step, self.caches, self.rope)
            source = sources[a.kv_source(self.layer)] if self.ratio else None
            if self.is_index_source:
                state.selection[self.layer] = self.indexer.select(
                    qr, x, positions, step, source.caches, self.rope, state)
            for r, rows, start, length in step.requests():
                keys, mask = self._window_keys(window_md, r, positions[rows], start, length)
                if self.ratio and length // self.ratio:
                    groups = torch.arange(length // self.ratio) * self.ratio
                    caches = source.caches
                    compressed = caches.latents.read(caches.latents.metadata(), r, groups)
                    keys = torch.cat([compressed, keys])
                    selected = state.selection[a.index_source(self.layer)][r]
                    mask = torch.cat([selected, mask], dim=1)
                out[rows] = ops.sink_attention(q[rows], keys, mask, self.attn_sink,
                                               a.head_dim ** -0.5)
        out = _rotate(self.rope, positions, out, inverse=True)
        return self.wo_b(ops.grouped_output(out, self.wo_a, a.o_groups))

    def _window_keys(self, md: PagedStepMetadata, r: int, query_pos: torch.Tensor, start: int,
                     length: int):
        """This layer's own latents in the window of any query of the chunk."""
        key_pos = torch.arange(max(0, start - self.a.sliding_window + 1), length)
        keys = self.window.read(md, r, key_pos)
        mask = ((key_pos[None, :] <= query_pos[:, None])
                & (key_pos[None, :] > query_pos[:, None] - self.a.sliding_window))
        return keys, mask


class V41Compressor(nn.Module):
    """Pools `ratio` tokens into one latent (ratio 2: per-dim softmax over the pair); runs in
    fp32 and writes latents and index keys into the kv source's caches."""

    def __init__(self, a: V41Args, layer: int, prefix: str):
        super().__init__()
        self.a, self.ratio = a, a.ratio(layer)
        self.wkv = _linear(a.hidden_size, a.head_dim, f"{prefix}.wkv", torch.float32)
        if self.ratio == 2:
            self.wgate = _linear(a.hidden_size, a.head_dim, f"{prefix}.wgate", torch.float32)
        self.norm = nn.Parameter(torch.ones(a.head_dim, dtype=torch.float32), requires_grad=False)
        self.wk = _linear(a.head_dim, a.index_head_dim, f"{prefix}.wk")
        self.k_norm = nn.Parameter(torch.ones(a.index_head_dim, dtype=torch.float32),
                                   requires_grad=False)

    def store(self, x: torch.Tensor, positions: torch.Tensor, step: StepBatch,
              caches: CompressedCaches, rope) -> None:
        kv = self.wkv(x.float())
        if self.ratio == 1:
            closing = torch.arange(x.shape[0])
            pooled = kv
        else:
            raw = torch.cat([kv, self.wgate(x.float())], dim=-1)
            state_md = caches.open_group.metadata()
            caches.open_group.write(state_md, state_md.slot_mapping, raw)
            # A group closes at an odd position; its first row may come from an earlier step.
            closing, previous = [], []
            for r, rows, _, _ in step.requests():
                local = (positions[rows] % 2 == 1).nonzero().flatten()
                closing.append(local + rows.start)
                previous.append(caches.open_group.read(state_md, r, positions[rows][local] - 1))
            closing = torch.cat(closing)
            if closing.numel() == 0:
                return
            previous = torch.cat(previous)
            current = raw[closing]
            d = self.a.head_dim
            pooled = ops.pool_pair(torch.stack([previous[:, :d], current[:, :d]]),
                                   torch.stack([previous[:, d:], current[:, d:]]))
        latent = ops.rms_norm(pooled, self.norm, self.a.rms_norm_eps)
        start = positions[closing] - (self.ratio - 1)
        index_keys = ops.rms_norm(self.wk(latent.to(self.wk.weight.dtype)), self.k_norm,
                                  self.a.rms_norm_eps)
        for cache, rows in ((caches.latents, latent), (caches.index_keys, index_keys)):
            md = cache.metadata()
            cache.write(md, md.slot_mapping[closing], _rotate(rope, start, rows))


def _index_scores(q_idx: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor):
    """The Triton kernel where tensors live on a GPU, the torch reference elsewhere."""
    if q_idx.is_cuda:
        from vllm_deepinfer.kernels.indexer_scores import index_scores

        return index_scores(q_idx, weights, keys)
    return ops.index_scores(q_idx, weights, keys)


class V41Indexer(nn.Module):
    """Lightning indexer: scores compressed positions and keeps each query's top-k."""

    def __init__(self, a: V41Args, layer: int, prefix: str):
        super().__init__()
        self.a, self.layer, self.ratio = a, layer, a.ratio(layer)
        self.wq_b = _linear(a.q_lora_rank, a.index_n_heads * a.index_head_dim, f"{prefix}.wq_b")
        self.weights_proj = _linear(a.hidden_size, a.index_n_heads, f"{prefix}.weights_proj")

    def select(self, qr: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
               step: StepBatch, caches: CompressedCaches, rope,
               state: CrossLayerState) -> dict[int, torch.Tensor]:
        a = self.a
        q = _rotate(rope, positions, self.wq_b(qr).view(-1, a.index_n_heads, a.index_head_dim))
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
                state.candidates[r] = ops.candidate_blocks(
                    scores, n_visible, a.candidate_block_size, a.candidate_topk_blocks)
            if a.reads_candidates(self.layer):
                allowed &= state.candidates[r]
            chosen[r] = ops.select_topk(scores, allowed, a.index_topk)
        return chosen


class V41Router(nn.Module):
    """sqrtsoftplus router; `bias` (fp32) steers expert selection only."""

    def __init__(self, a: V41Args):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(a.n_routed_experts, a.hidden_size),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(a.n_routed_experts, dtype=torch.float32),
                                 requires_grad=False)


class V41Experts(nn.Module):
    """Routed experts stacked as [E, 2I, H] (w1 rows, then w3) and [E, H, I]."""

    def __init__(self, a: V41Args):
        super().__init__()
        e, i, h = a.n_routed_experts, a.moe_intermediate_size, a.hidden_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)


class V41SharedExpert(nn.Module):
    def __init__(self, a: V41Args, prefix: str):
        super().__init__()
        inter = a.moe_intermediate_size * a.n_shared_experts
        self.w1 = _linear(a.hidden_size, inter, f"{prefix}.w1")
        self.w3 = _linear(a.hidden_size, inter, f"{prefix}.w3")
        self.w2 = _linear(inter, a.hidden_size, f"{prefix}.w2")
        self.limit = a.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ops.clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class V41MoE(nn.Module):
    """Routed experts in torch: vLLM's CPU fused-MoE kernels offer plain SiLU only (no
    clamped SwiGLU) and bf16 only, so FusedMoE cannot run V4.1's experts on the CPU."""

    def __init__(self, a: V41Args, prefix: str):
        super().__init__()
        self.a = a
        self.gate = V41Router(a)
        self.experts = V41Experts(a)
        self.shared_experts = V41SharedExpert(a, f"{prefix}.shared_experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a
        logits = x.float() @ self.gate.weight.float().T
        weights, chosen = ops.route(logits, self.gate.bias, a.num_experts_per_tok,
                                    a.routed_scaling_factor)
        out = self.shared_experts(x)
        inter = a.moe_intermediate_size
        for e in chosen.unique().tolist():
            tokens, slot = (chosen == e).nonzero(as_tuple=True)
            gate_up = x[tokens] @ self.experts.w13[e].T
            act = ops.clamped_swiglu(gate_up[:, :inter], gate_up[:, inter:], a.swiglu_limit)
            routed = (act @ self.experts.w2[e].T) * weights[tokens, slot, None].to(x.dtype)
            out = out.index_add(0, tokens, routed)
        return out


class V41Engram(nn.Module):
    """Hashed n-gram memory gated into each residual copy."""

    def __init__(self, a: V41Args, layer: int, prefix: str):
        super().__init__()
        self.a, self.layer = a, layer
        rows = a.engram_num_embeddings[a.engram_layer_ids.index(layer)]
        self.embed = nn.Embedding(rows, a.engram_head_dim)
        self.embed.weight.requires_grad_(False)
        self.wkv = _linear(a.engram_columns * a.engram_head_dim,
                           (a.hc_mult + 1) * a.hidden_size, f"{prefix}.wkv")
        self.q_weight = nn.Parameter(torch.empty(a.hc_mult, a.hidden_size), requires_grad=False)
        self.k_weight = nn.Parameter(torch.empty(a.hc_mult, a.hidden_size), requires_grad=False)

    def forward(self, copies: torch.Tensor, table_rows: torch.Tensor) -> torch.Tensor:
        hc, h = self.a.hc_mult, self.a.hidden_size
        projected = self.wkv(self.embed(table_rows).flatten(1))
        keys = projected[:, : hc * h].view(-1, hc, h)
        return ops.engram_gate(copies, keys, projected[:, hc * h:], self.q_weight,
                               self.k_weight, self.a.rms_norm_eps)


class V41DecoderLayer(nn.Module):
    def __init__(self, a: V41Args, layer: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self.a, self.layer = a, layer
        mixes = (2 + a.hc_mult) * a.hc_mult
        for boundary in ("attn", "ffn"):
            for part, shape in (("fn", (mixes, a.hc_mult * a.hidden_size)), ("base", (mixes,)),
                                ("scale", (3,))):
                self.register_parameter(f"hc_{boundary}_{part}", nn.Parameter(
                    torch.empty(shape, dtype=torch.float32), requires_grad=False))
        self.attn_norm = RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.ffn_norm = RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.attn = V41Attention(a, layer, f"{prefix}.attn", vllm_config)
        self.ffn = V41MoE(a, f"{prefix}.ffn")
        self.engram = (V41Engram(a, layer, f"{prefix}.engram")
                       if layer in a.engram_layer_ids else None)

    def mixes(self, copies: torch.Tensor, boundary: str):
        a = self.a
        return ops.hc_mixes(copies, getattr(self, f"hc_{boundary}_fn"),
                            getattr(self, f"hc_{boundary}_base"),
                            getattr(self, f"hc_{boundary}_scale"), a.hc_eps, a.rms_norm_eps,
                            a.hc_sinkhorn_iters)


class V41Model(nn.Module):
    def __init__(self, a: V41Args, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.a = a
        self.embed = VocabParallelEmbedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(V41DecoderLayer(a, i, f"{prefix}.layers.{i}", vllm_config)
                                    for i in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.engram_history = None
        if a.engram_layer_ids:
            # Token history for n-grams that reach back across chunk and decode steps.
            self.engram_history = PagedCache(
                f"{prefix}.layers.{a.engram_layer_ids[0]}.engram.token_history",
                SlidingWindowMLASpec(block_size=vllm_config.cache_config.block_size,
                                     num_kv_heads=1, head_size=1, dtype=torch.float32,
                                     sliding_window=a.engram_max_ngram_size))

    def prepare_engram(self, tokenizer_dir: str) -> None:
        """Builds Engram's addressing from the tokenizer (after loading, so that the model
        itself can be instantiated without one) and checks it against the config."""
        a = self.a
        tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
        compressed, count = compressed_vocabulary(tokenizer, a.vocab_size)
        if count != a.engram_compressed_vocab_size:
            raise ValueError(f"the tokenizer normalises to {count} Engram ids, but the config "
                             f"says engram_compressed_vocab_size={a.engram_compressed_vocab_size}")
        self.compressed_ids = compressed
        self.hashing = EngramHashing(a, count, int(compressed[a.engram_pad_token_id]))
        for layer, rows in zip(a.engram_layer_ids, a.engram_num_embeddings):
            if self.hashing.rows_needed(layer) > rows:
                raise ValueError(f"Engram layer {layer} hashes into "
                                 f"{self.hashing.rows_needed(layer)} rows but "
                                 f"engram_num_embeddings gives {rows}")

    def _ngram_history(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       step: StepBatch | None) -> torch.Tensor:
        """[T, max_ngram] compressed ids at p, p-1, ... (NO_TOKEN before the start)."""
        n = self.a.engram_max_ngram_size
        compressed = self.compressed_ids[input_ids]
        history = torch.full((input_ids.shape[0], n), NO_TOKEN, dtype=torch.int64)
        md = self.engram_history.metadata()
        if step is None or md is None:
            history[:, 0] = compressed
            return history
        self.engram_history.write(md, md.slot_mapping, compressed.float()[:, None])
        for r, rows, _, _ in step.requests():
            pos = positions[rows]
            for back in range(n):
                earlier = pos - back
                valid = earlier >= 0
                ids = self.engram_history.read(md, r, earlier.clamp_min(0))[:, 0].long()
                history[rows, back] = torch.where(valid, ids, NO_TOKEN)
        return history

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        step = StepBatch.from_metadata(self.layers[0].attn.window.metadata())
        if step is None or step.num_tokens == input_ids.shape[0]:
            return self._forward(input_ids, positions, step)
        # The runner may pad the batch; padding rows own no cache slots.
        hidden = self._forward(input_ids[: step.num_tokens], positions[: step.num_tokens], step)
        padded = hidden.new_zeros(input_ids.shape[0], hidden.shape[1])
        padded[: step.num_tokens] = hidden
        return padded

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 step: StepBatch | None) -> torch.Tensor:
        a = self.a
        state = CrossLayerState()
        sources = {i: self.layers[i].attn for i in a.kv_source_layer_ids}
        x = self.embed(input_ids)
        copies = x[:, None, :].expand(-1, a.hc_mult, -1).contiguous()
        table_rows = {}
        if self.engram_history is not None:
            history = self._ngram_history(input_ids, positions, step)
            table_rows = {layer: self.hashing.rows(layer, history) for layer in a.engram_layer_ids}
        ffn_pre = ffn_post = ffn_comb = ffn_out = None
        for layer in self.layers:
            if ffn_out is not None:
                copies = ops.hc_update(copies, ffn_comb, ffn_post, ffn_out)
            if layer.engram is not None:
                copies = layer.engram(copies, table_rows[layer.layer])
            # V4.1 collapses with the previous boundary's pre (copy 0 before the first).
            attn_pre, attn_post, attn_comb = layer.mixes(copies, "attn")
            attn_in = layer.attn_norm(ops.hc_collapse(copies, ffn_pre))
            attn_out = layer.attn(attn_in, positions, step, sources, state)
            copies = ops.hc_update(copies, attn_comb, attn_post, attn_out)
            ffn_pre, ffn_post, ffn_comb = layer.mixes(copies, "ffn")
            ffn_out = layer.ffn(layer.ffn_norm(ops.hc_collapse(copies, attn_pre)))
        copies = ops.hc_update(copies, ffn_comb, ffn_post, ffn_out)
        return self.norm(ops.hc_collapse(copies, ffn_pre))


# Checkpoint names that differ from parameter names (everything else is `model.` + name).
_RENAMES = (
    ("attn.compressor.norm.weight", "attn.compressor.norm"),
    ("attn.indexer.wk.weight", "attn.compressor.wk.weight"),
    ("attn.indexer.k_norm.weight", "attn.compressor.k_norm"),
    ("attn.wo_a.weight", "attn.wo_a"),
)


class DeepseekV41ForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        if vllm_config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("vllm-deepinfer's V4.1 model runs with tensor_parallel_size=1")
        self.config = config
        self.tokenizer_dir = vllm_config.model_config.tokenizer
        self.args = V41Args.from_hf_config(config)
        self.model = V41Model(self.args, vllm_config, f"{prefix}model" if not prefix
                              else f"{prefix}.model")
        self.lm_head = ParallelLMHead(self.args.vocab_size, self.args.hidden_size)
        self.logits_processor = LogitsProcessor(self.args.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds=None, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    @staticmethod
    def param_name(checkpoint_name: str) -> str:
        """Where a DeepSeek-native tensor lives in this module tree (experts excluded)."""
        if checkpoint_name == "head.weight":
            return "lm_head.weight"
        for old, new in _RENAMES:
            if checkpoint_name.endswith(old):
                return "model." + checkpoint_name[: -len(old)] + new
        return "model." + checkpoint_name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads DeepSeek-native tensors (bf16 or the release's MXFP8/MXFP4); DSpark stages
        are skipped until speculative decoding uses them."""
        params = dict(self.named_parameters())
        inter = self.args.moe_intermediate_size
        expert_rows = {"w1": slice(0, inter), "w3": slice(inter, 2 * inter), "w2": slice(None)}
        backbone = ((n, t) for n, t in weights if not n.startswith("mtp."))
        loaded: set[str] = set()
        for name, tensor in checked(backbone, backbone_layout(self.args, quantized=False)):
            if ".ffn.experts." in name:
                prefix, expert, which, _ = name.rsplit(".", 3)
                stacked = f"model.{prefix}.{'w2' if which == 'w2' else 'w13'}"
                params[stacked].data[int(expert), expert_rows[which]].copy_(tensor)
                loaded.add(stacked)
                continue
            target = self.param_name(name)
            param = params[target]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
        if self.args.engram_layer_ids:
            self.model.prepare_engram(self.tokenizer_dir)
        return loaded
