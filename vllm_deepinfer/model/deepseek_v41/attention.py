"""Single-latent MLA with sinks: every head attends over one 512-wide latent per key
(key = value), drawn from the layer's own sliding window plus, on compressed layers, the
top-k compressed latents its index source chose. The output gets the inverse RoPE at the
query position and a grouped low-rank projection (`wo_a` per group, then `wo_b`)."""

from __future__ import annotations

import torch
import torch.nn as nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm

from vllm_deepinfer.checkpoint.mx_formats import BLOCK
from vllm_deepinfer.determinism import batch_invariant
from vllm_deepinfer.kernels import sparse_attention
from vllm_deepinfer.kv_cache.bounded_replay import ReplaySettings
from vllm_deepinfer.kv_cache.paged import PagedStepMetadata
from vllm_deepinfer.kv_cache.specs import CompressedCaches, swa_latents
from vllm_deepinfer.model.deepseek_v41 import layer_ops
from vllm_deepinfer.model.deepseek_v41.args import V41Args
from vllm_deepinfer.model.deepseek_v41.compressor import V41Compressor
from vllm_deepinfer.model.deepseek_v41.indexer import V41Indexer
from vllm_deepinfer.model.deepseek_v41.layer_ops import register_owner
from vllm_deepinfer.model.deepseek_v41.ops import column_linear, linear, row_linear, wide
from vllm_deepinfer.model.deepseek_v41.parallel import TensorSplit
from vllm_deepinfer.model.deepseek_v41.quantization import (
    check_blocks,
    keeps_release_precision,
    mx_linear,
)
from vllm_deepinfer.model.deepseek_v41.rope import make_rope, rotate
from vllm_deepinfer.model.deepseek_v41.step import DraftBlock, RequestGroup, StepContext, StepScope

KEY_BUDGET = 1 << 24
"""Most gathered key elements the paged attention holds at once (64 MiB in fp32): long
chunks and many requests attend in tiles."""

QUERY_TILE = 64
"""Consecutive queries of one request that attend together: their windows overlap, so the
tile reads its QUERY_TILE + W - 1 window keys once instead of W keys for every query."""


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [T, nH, D], keys [K, D] (value = key), mask [T, K]; the per-head sink is one more
    logit with a zero value, so heads may attend to nothing."""
    logits = torch.einsum("thd,kd->thk", wide(q), wide(keys)) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink_logits = wide(sink)[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.cat([logits, sink_logits], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("thk,kd->thd", probs, wide(keys)).to(q.dtype)


def tiled_sink_attention(
    q: torch.Tensor,
    span_keys: torch.Tensor,
    span_mask: torch.Tensor,
    own_keys: torch.Tensor | None,
    own_mask: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`sink_attention` for tiles of R requests x S queries: q [R, S, nH, D]; span_keys
    [R, K, D] read by every query of a row (its window span), span_mask [R, S, K]; own_keys
    [R, S, k, D] per query (its top-k compressed keys), own_mask [R, S, k]. One softmax over
    both sets and the sink."""
    qw = wide(q)
    logits = torch.einsum("rshd,rkd->rshk", qw, wide(span_keys)) * scale
    logits = logits.masked_fill(~span_mask[:, :, None, :], float("-inf"))
    parts = [logits]
    if own_keys is not None:
        own = torch.einsum("rshd,rskd->rshk", qw, wide(own_keys)) * scale
        parts.insert(0, own.masked_fill(~own_mask[:, :, None, :], float("-inf")))
    parts.append(wide(sink)[None, None, :, None].expand(*q.shape[:3], 1))
    probs = torch.cat(parts, dim=-1).softmax(-1)
    own_width = 0 if own_keys is None else own_keys.shape[2]
    out = torch.einsum("rshk,rkd->rshd", probs[..., own_width:-1], wide(span_keys))
    if own_keys is not None:
        out = out + torch.einsum("rshk,rskd->rshd", probs[..., :own_width], wide(own_keys))
    return out.to(q.dtype)


def per_query_sink_attention(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """`sink_attention` with every query's own keys in one fixed layout, for
    batch-invariant mode: q [T, nH, D], keys [T, K, D], mask [T, K]. Each query's logits,
    softmax and weighted sum run over the same K slots in the same order whatever else
    the step holds (masked slots weigh exactly 0)."""
    qw, kw = wide(q), wide(keys)
    logits = batch_invariant.bmm(qw, kw.transpose(1, 2)) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink_logits = wide(sink)[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.cat([logits, sink_logits], dim=-1).softmax(-1)[..., :-1]
    return batch_invariant.bmm(probs, kw).to(q.dtype)


def grouped_output(
    o: torch.Tensor, wo_a: torch.Tensor, o_groups: int, wo_a_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-group low-rank output: [T, nH, D] -> [T, o_groups * o_lora_rank]; `wo_a_scale`
    where wo_a is held as released (MXFP8: each group's rows are whole scale blocks)."""
    t = o.shape[0]
    grouped = o.reshape(t, o_groups, -1)
    if wo_a_scale is not None:
        rows = wo_a.shape[0] // o_groups
        blocks = wo_a_scale.shape[0] // o_groups
        return torch.cat(
            [
                mx_linear(
                    grouped[:, g],
                    wo_a[g * rows : (g + 1) * rows],
                    wo_a_scale[g * blocks : (g + 1) * blocks],
                    False,
                )
                for g in range(o_groups)
            ],
            dim=-1,
        )
    w = wo_a.view(o_groups, -1, grouped.shape[-1])
    if batch_invariant.enabled():
        return torch.cat(
            [batch_invariant.linear(grouped[:, g], w[g]) for g in range(o_groups)], dim=-1
        )
    # One bmm over the groups (an einsum traces into about twice the graph nodes).
    per_group = torch.bmm(grouped.transpose(0, 1), w.to(o.dtype).transpose(1, 2))
    return per_group.transpose(0, 1).reshape(t, -1)


class V41Attention(nn.Module):
    def __init__(
        self, a: V41Args, layer: int, prefix: str, vllm_config: VllmConfig, replay: ReplaySettings
    ):
        super().__init__()
        self.a, self.layer, self.ratio = a, layer, a.ratio(layer)
        # Decoder-side replay: layers after the cut attend nothing before `kept_from`
        # (DSpark stages, numbered after the backbone, read only their own windows).
        self.after_cut = replay.cut is not None and replay.cut < layer < a.num_hidden_layers
        H, D, Q = a.hidden_size, a.head_dim, a.q_lora_rank
        block_size = vllm_config.cache_config.block_size
        dtype = vllm_config.model_config.dtype
        # Tensor parallelism splits the heads, their sinks and the output groups.
        split = TensorSplit.current()
        self.heads = split.part(a.num_attention_heads, "num_attention_heads")
        self.o_groups = split.part(a.o_groups, "o_groups")
        self.wq_a = linear(H, Q, f"{prefix}.wq_a", quantized=True)
        self.wkv = linear(H, D, f"{prefix}.wkv", quantized=True)
        self.q_norm = RMSNorm(Q, eps=a.rms_norm_eps)
        self.kv_norm = RMSNorm(D, eps=a.rms_norm_eps)
        self.wq_b = column_linear(Q, a.num_attention_heads * D, f"{prefix}.wq_b", quantized=True)
        wo_a_shape = (self.o_groups * a.o_lora_rank, a.num_attention_heads * D // a.o_groups)
        self.wo_a_scale = None
        if keeps_release_precision(vllm_config.quant_config):
            check_blocks(f"{prefix}.wo_a", o_lora_rank=a.o_lora_rank, columns=wo_a_shape[1])
            self.wo_a = nn.Parameter(
                torch.empty(wo_a_shape, dtype=torch.float8_e4m3fn), requires_grad=False
            )
            self.wo_a_scale = nn.Parameter(
                torch.empty(wo_a_shape[0] // BLOCK, wo_a_shape[1] // BLOCK, dtype=torch.uint8),
                requires_grad=False,
            )
            self.wo_a_scale.weight_loader = split.loader(0)
        else:
            self.wo_a = nn.Parameter(torch.empty(wo_a_shape), requires_grad=False)
        self.wo_a.weight_loader = split.loader(0)
        self.wo_b = row_linear(a.o_groups * a.o_lora_rank, H, f"{prefix}.wo_b", quantized=True)
        self.attn_sink = nn.Parameter(
            torch.empty(self.heads, dtype=torch.float32), requires_grad=False
        )
        self.attn_sink.weight_loader = split.loader(0)
        self.rope = make_rope(a, self.ratio)
        self.window = swa_latents(prefix, a, block_size, dtype, replay.keep)
        self.is_kv_source = layer in a.kv_source_layer_ids
        self.is_index_source = layer in a.index_source_layer_ids
        if self.is_kv_source:
            self.compressor = V41Compressor(a, layer, f"{prefix}.compressor")
            self.caches = CompressedCaches(
                a, layer, prefix, block_size, dtype, replay.keep, vllm_config
            )
        if self.is_index_source:
            self.indexer = V41Indexer(a, layer, f"{prefix}.indexer")
        self.scope: StepScope | None = None  # the model's (model.py); the backbone only
        self.op_name = register_owner(prefix, self)

    def _latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rotate(self.rope, positions, self.kv_norm(self.wkv(x)))

    def write_kv(
        self,
        ctx: StepContext,
        latent: torch.Tensor,
        compressed: torch.Tensor | None,
        compressed_index_keys: torch.Tensor | None,
    ) -> None:
        """Stores this layer's window latents and, on a kv source, its compressed KV for
        the context's tokens from the compressor's `project` rows (decoder-side replay
        calls it on every row of the cut layer before the layer attends on the kept rows
        only)."""
        window_md = self.window.metadata()
        if ctx.batch is None or window_md is None:
            return
        self.window.write(window_md, ctx.slots(window_md), latent)
        if self.is_kv_source:
            self.compressor.store(
                compressed, compressed_index_keys, ctx.positions, ctx.batch, self.caches, self.rope
            )

    def _queries(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(qr, the RoPE'd queries [T, heads, head_dim]); the indexer also reads qr."""
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(-1, self.heads, self.a.head_dim)
        return qr, rotate(self.rope, positions, q)

    def _output(self, out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Attention output [T, heads, head_dim] -> [T, H]: inverse RoPE, grouped wo_a,
        wo_b."""
        out = rotate(self.rope, positions, out, inverse=True)
        return self.wo_b(grouped_output(out, self.wo_a, self.o_groups, self.wo_a_scale))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: the projections and RoPE around the layer's opaque op
        (`attend_step`), which reads and writes the caches."""
        qr, q = self._queries(x, positions)
        index_q = index_weights = compressed = compressed_index_keys = None
        if self.is_index_source:
            index_q, index_weights = self.indexer.queries(qr, x, positions, self.rope)
        if self.is_kv_source:
            compressed, compressed_index_keys = self.compressor.project(x, positions, self.rope)
        out = torch.zeros_like(q)
        layer_ops.attention(
            q,
            self._latent(x, positions),
            compressed,
            compressed_index_keys,
            index_q,
            index_weights,
            positions,
            out,
            self.op_name,
        )
        return self._output(out, positions)

    def attend_step(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        compressed: torch.Tensor | None,
        compressed_index_keys: torch.Tensor | None,
        index_q: torch.Tensor | None,
        index_weights: torch.Tensor | None,
        positions: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """The layer op (layer_ops.py): stores this step's KV, selects the top-k and
        attends, writing `out` at the rows this layer computes (zeros elsewhere, and in
        profile runs). From the cut layer on, a trimmed step computes its kept rows."""
        scope = self.scope
        ctx = scope.context(positions)
        window_md = self.window.metadata()
        if ctx.batch is None or window_md is None:
            return
        n = ctx.batch.num_tokens
        rows = [
            None if t is None else t[:n]
            for t in (q, latent, compressed, compressed_index_keys, index_q, index_weights)
        ]
        if self.layer == scope.cut and scope.trim():
            self.write_kv(ctx, *rows[1:4])  # every row's KV, before the kept attend
        ctx, kept = scope.rows(self.layer, positions)
        if kept is not None:
            if kept.numel() == 0:
                return
            rows = [None if t is None else t[kept] for t in rows]
        q, latent, compressed, compressed_index_keys, index_q, index_weights = rows
        # Every path below writes every row: all rows go straight into `out` when kept.
        result = out[:n] if kept is None else torch.empty_like(q)
        if self.layer not in ctx.kv_written:
            self.write_kv(ctx, latent, compressed, compressed_index_keys)
        if self.is_index_source:
            ctx.selection[self.layer] = self.indexer.select(
                index_q,
                index_weights,
                ctx.positions,
                ctx.batch,
                ctx.sources[self.a.kv_source(self.layer)].caches,
                ctx.candidates,
            )
        if batch_invariant.enabled():
            self._attend_each_query(q, result, ctx, window_md)
        elif self._kernel_reads(ctx):
            self._attend_in_kernel(q, result, ctx, window_md)
        else:
            for group in ctx.batch.groups:
                self._attend(q, result, ctx, window_md, group)
        if kept is not None:
            out.index_copy_(0, kept, result)

    def block_forward(
        self, x: torch.Tensor, positions: torch.Tensor, stage: int, draft_name: str
    ) -> torch.Tensor:
        """A DSpark stage's attention over the draft blocks, x [B*N, H] at positions
        [B*N]: the projections and RoPE around the draft's layer op (`attend_block`, through
        the draft module, which holds the block)."""
        q = self._queries(x, positions)[1]
        out = torch.zeros_like(q)
        layer_ops.draft_attention(q, self._latent(x, positions), out, stage, draft_name)
        return self._output(out, positions)

    def attend_block(
        self,
        q: torch.Tensor,
        own: torch.Tensor,
        block: DraftBlock,
        window_md: PagedStepMetadata,
        out: torch.Tensor,
    ) -> None:
        """Every query of a block sees the same keys, non-causally: the last
        `sliding_window` context positions before the anchor (latents the target's step
        wrote into this stage's window) and the block's own latents `own` [B*N, D], kept
        in scratch (the next step's context overwrites those positions). Writes `out`
        [B*N, heads, head_dim]."""
        a, W = self.a, self.a.sliding_window
        b, n = block.positions.shape
        q = q.view(b, n, self.heads, a.head_dim)
        context = block.positions[:, :1] - W + torch.arange(W, device=q.device)
        first = block.first_key[:, None]
        visible = context >= first.clamp_min(0)
        # Masked keys are read too: only from positions the request wrote.
        keys = self.window.read(window_md, block.requests[:, None], torch.maximum(context, first))
        keys = torch.cat([keys, own.view(b, n, -1)], 1)
        mask = torch.cat([visible, visible.new_ones(b, n)], 1)[:, None, :].expand(b, n, -1)
        if batch_invariant.enabled():
            result = per_query_sink_attention(
                q.flatten(0, 1),
                keys[:, None].expand(-1, n, -1, -1).flatten(0, 1),
                mask.flatten(0, 1),
                self.attn_sink,
                a.head_dim**-0.5,
            )
        else:
            result = tiled_sink_attention(
                q, keys, mask, None, None, self.attn_sink, a.head_dim**-0.5
            ).flatten(0, 1)
        out.copy_(result)

    def _kernel_reads(self, ctx: StepContext) -> bool:
        """Whether the C kernel (kernels/sparse_attention.py) reads this layer's caches."""
        if not sparse_attention.usable() or not sparse_attention.reads_cache(self.window):
            return False
        if not self.ratio:
            return True
        return sparse_attention.reads_cache(
            ctx.sources[self.a.kv_source(self.layer)].caches.latents
        )

    def _attend_in_kernel(
        self, q: torch.Tensor, out: torch.Tensor, ctx: StepContext, window_md: PagedStepMetadata
    ) -> None:
        """Every query at once through the C kernel, from the caches themselves: the
        same keys, mask and softmax as `_attend`."""
        a, step = self.a, ctx.batch
        window = sparse_attention.cache_view(self.window, window_md)
        compressed = groups = valid = None
        if self.ratio:
            top = ctx.selection[a.index_source(self.layer)]
            latents = ctx.sources[a.kv_source(self.layer)].caches.latents
            compressed = sparse_attention.cache_view(latents, latents.metadata())
            groups, valid = top.groups, top.valid
        sparse_attention.attend(
            q,
            step.request_of_token,
            ctx.positions,
            step.kept_from if self.after_cut else step.replay_start,
            window,
            a.sliding_window,
            compressed,
            self.ratio,
            groups,
            valid,
            self.attn_sink,
            a.head_dim**-0.5,
            out=out,
        )

    def _attend_each_query(
        self, q: torch.Tensor, out: torch.Tensor, ctx: StepContext, window_md: PagedStepMetadata
    ) -> None:
        """Batch-invariant attention: each query reads its keys in one layout that depends
        on nothing but itself, its top-k compressed keys in selection order, then the
        W window positions ending at its own, and attends over them alone; in chunks of
        queries that bound the gathered keys."""
        a, W = self.a, self.a.sliding_window
        step = ctx.batch
        first_key = step.kept_from if self.after_cut else step.replay_start
        offsets = torch.arange(W, device=q.device) - (W - 1)
        width = W + (a.index_topk if self.ratio else 0)
        chunk = max(1, KEY_BUDGET // (width * a.head_dim))
        for t0 in range(0, q.shape[0], chunk):
            tokens = torch.arange(t0, min(t0 + chunk, q.shape[0]), device=q.device)
            requests = step.request_of_token[tokens][:, None]
            first = first_key[requests]
            key_pos = ctx.positions[tokens][:, None] + offsets
            mask = key_pos >= first  # also rules out positions < 0
            # Masked keys are read too: only from rows this request wrote.
            keys = self.window.read(window_md, requests, torch.maximum(key_pos, first))
            if self.ratio:
                top = ctx.selection[a.index_source(self.layer)]
                valid = top.valid[tokens]
                latents = ctx.sources[a.kv_source(self.layer)].caches.latents
                chosen = latents.read(
                    latents.metadata(),
                    requests,
                    torch.where(valid, top.groups[tokens], 0) * self.ratio,
                )
                keys, mask = torch.cat([chosen, keys], 1), torch.cat([valid, mask], 1)
            out[tokens] = per_query_sink_attention(
                q[tokens], keys, mask, self.attn_sink, a.head_dim**-0.5
            )

    def _attend(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        ctx: StepContext,
        window_md: PagedStepMetadata,
        group: RequestGroup,
    ) -> None:
        """Attention of one padded request group, in tiles of up to QUERY_TILE queries per
        request: each tile reads its requests' window spans once, and the compressed keys
        `_compressed_keys` chooses; the results land in `out` at the tiles' tokens."""
        a, W = self.a, self.a.sliding_window
        num_requests, width = group.tokens.shape
        span = min(width, QUERY_TILE)
        top_k = a.index_topk if self.ratio else 0
        keys_per_request = (span + W - 1 + span * top_k) * a.head_dim
        rows = max(1, KEY_BUDGET // keys_per_request)
        offsets = torch.arange(span + W - 1, device=q.device) - (W - 1)
        # Replay: a recomputed window starts at the replay start (or the kept rows).
        first_key = ctx.batch.kept_from if self.after_cut else ctx.batch.replay_start
        for r0 in range(0, num_requests, rows):
            requests = group.requests[r0 : r0 + rows, None]
            last_pos = group.seq_lens[r0 : r0 + rows, None] - 1
            for q0 in range(0, width, span):
                tokens = group.tokens[r0 : r0 + rows, q0 : q0 + span]
                present = tokens >= 0
                tokens = tokens.clamp_min(0)
                pos = ctx.positions[tokens]
                # A row whose chunk ended before this tile reads its last position (masked).
                key_pos = pos[:, :1] + offsets
                delta = pos[:, :, None] - key_pos[:, None, :]
                visible = key_pos >= first_key[requests]  # also rules out positions < 0
                span_mask = (delta >= 0) & (delta < W) & visible[:, None, :]
                span_mask &= present[:, :, None]
                # Masked keys are still read: only from rows this request wrote (a
                # replayed or trimmed window's older rows hold another request's data).
                span_keys = self.window.read(
                    window_md,
                    requests,
                    torch.maximum(key_pos, first_key[requests]).minimum(last_pos),
                )
                own_keys = own_mask = None
                if self.ratio:
                    shared, own = self._compressed_keys(
                        ctx, requests, last_pos, tokens, present, pos, span
                    )
                    if shared is not None:
                        span_keys = torch.cat([shared[0], span_keys], 1)
                        span_mask = torch.cat([shared[1], span_mask], 2)
                    if own is not None:
                        own_keys, own_mask = own
                result = tiled_sink_attention(
                    q[tokens],
                    span_keys,
                    span_mask,
                    own_keys,
                    own_mask,
                    self.attn_sink,
                    a.head_dim**-0.5,
                )
                out[tokens[present]] = result[present]

    def _compressed_keys(
        self,
        ctx: StepContext,
        requests: torch.Tensor,
        last_pos: torch.Tensor,
        tokens: torch.Tensor,
        present: torch.Tensor,
        pos: torch.Tensor,
        span: int,
    ):
        """A tile's compressed keys, as (keys [R, G, D], mask [R, S, G]) shared by its
        queries or as (keys [R, S, k, D], mask [R, S, k]) per query, the other None. While
        the tile's requests have no more complete groups than its queries choose in all
        (short contexts), every complete group is read once and masked to each query's
        top-k; past that, each query's top-k are gathered."""
        a = self.a
        top = ctx.selection[a.index_source(self.layer)]
        chosen = top.valid[tokens] & present[:, :, None]
        groups = torch.where(chosen, top.groups[tokens], 0)
        latents = ctx.sources[a.kv_source(self.layer)].caches.latents
        latents_md = latents.metadata()
        complete = (int(torch.where(present, pos, 0).max()) + 1) // self.ratio
        if complete == 0:
            return None, None
        if complete > span * groups.shape[2]:
            return None, (
                latents.read(latents_md, requests[:, :, None], groups * self.ratio),
                chosen,
            )
        group_pos = (torch.arange(complete, device=pos.device) * self.ratio).minimum(last_pos)
        mask = torch.zeros(*groups.shape[:2], complete, dtype=torch.int8, device=pos.device)
        mask.scatter_add_(2, groups, chosen.to(torch.int8))
        return (latents.read(latents_md, requests, group_pos), mask > 0), None
