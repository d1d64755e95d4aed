"""A plain-PyTorch forward of DeepSeek V4.1 over one whole sequence, written to be read.

No paging, no batching, no caches: every layer sees the full sequence and builds its key
set from dense masks. It is the oracle the paged vLLM model is tested against, so it
shares the per-token math and the layer step (`decoder_step`) with it, never the way
keys are gathered; tests/model/ checks that shared math against code from outside the
project.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from vllm_deepinfer.checkpoint.layout import checkpoint_layout
from vllm_deepinfer.checkpoint.loader import dequantized
from vllm_deepinfer.model.deepseek_v41.args import IMAGE_TOKEN_ID, V41Args
from vllm_deepinfer.model.deepseek_v41.attention import grouped_output, sink_attention
from vllm_deepinfer.model.deepseek_v41.compressor import pool_pair
from vllm_deepinfer.model.deepseek_v41.decoder import decoder_step
from vllm_deepinfer.model.deepseek_v41.dspark import block_inputs, entry_stream, markov_draft
from vllm_deepinfer.model.deepseek_v41.engram import (NO_TOKEN, engram_addressing, engram_gate,
                                                      history_ids)
from vllm_deepinfer.model.deepseek_v41.hyper_connections import hc_collapse, hc_mixes
from vllm_deepinfer.model.deepseek_v41.indexer import candidate_blocks, index_scores, select_topk
from vllm_deepinfer.model.deepseek_v41.moe import (clamped_swiglu, route, routed_as_image,
                                                   selection_bias)
from vllm_deepinfer.model.deepseek_v41.ops import rms_norm, stable_topk
from vllm_deepinfer.model.deepseek_v41.rope import apply_rope, layer_rope_scaling, rope_inv_freq
from vllm_deepinfer.model.reference_vision import aligned_cells, image_span, vit


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def read_checkpoint(path: str) -> tuple[V41Args, dict[str, torch.Tensor]]:
    """Config and dequantized tensors (backbone, DSpark stages, vision path) of a
    checkpoint directory."""
    args = V41Args.from_release_config(read_config(path))

    def tensors():
        for file in sorted(os.listdir(path)):
            if file.endswith(".safetensors"):
                with safe_open(os.path.join(path, file), "pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

    layout = checkpoint_layout(args, quantized=True)
    return args, dict(dequantized(tensors(), layout))


@dataclass(frozen=True)
class Tie:
    """A near-tied top-k selection: pass (0: the exact computation, n: the n-th replay),
    layer, row (token position) and margin."""
    number: int
    layer: int
    row: int
    margin: float

    @property
    def key(self) -> tuple[int, int, int]:
        return self.number, self.layer, self.row


NO_TIES = (0.0, frozenset())
"""(tie tolerance, ties flipped) outside `logits`: selections as select_topk makes them."""


class ReferenceV41:
    def __init__(self, path: str, dtype: torch.dtype = torch.float64, records=(None, None)):
        """`records`: the stored formats (kv_cache/precision.py) of compressed latents and
        index keys, None for full precision."""
        self.records = records
        self._ties = NO_TIES
        self.args, weights = read_checkpoint(path)
        self.config = read_config(path)
        self.w = {name: t.to(dtype) for name, t in weights.items()}
        a = self.args
        tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        self.compressed_ids, self.hashing = engram_addressing(tokenizer, a)
        self.inv_freq = {r: rope_inv_freq(a.qk_rope_head_dim,
                                          a.compress_rope_theta if r else a.rope_theta,
                                          layer_rope_scaling(a.rope_scaling, r))
                         for r in (0, 1, 2)}

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w[name], self.args.rms_norm_eps)

    def _mixes(self, copies: torch.Tensor, prefix: str):
        a = self.args
        return hc_mixes(copies, self.w[prefix + "_fn"], self.w[prefix + "_base"],
                        self.w[prefix + "_scale"], a.hc_eps, a.rms_norm_eps,
                        a.hc_sinkhorn_iters)

    @torch.no_grad()
    def image_spans(self, images) -> list[torch.Tensor]:
        """Each PIL image's span of embeddings [span, H]: the release's preprocessing
        (upstream vLLM's port, which the engine runs too), then the vision path of
        reference_vision.py."""
        from vllm.models.deepseek_v41.common.mm_preprocess import DeepseekV4VLImageProcessor
        from vllm.transformers_utils.configs.deepseek_v41 import DeepseekV41Config

        preprocess = DeepseekV4VLImageProcessor(DeepseekV41Config(**self.config))
        v = self.args.vision | {"vision_rope_theta": self.config["vision_config"].get(
            "rope_theta", 10000.0)}
        dtype = self.w["embed.weight"].dtype
        spans = []
        for image in images:
            patches, rows, cols, cell_rows, cell_cols = preprocess(image)
            features = vit(self.w, v, patches.to(dtype), rows, cols)
            cells = aligned_cells(self.w, v["vision_downsample_ratio"], features, rows, cols)
            spans.append(image_span(self.w, cells, cell_rows, cell_cols))
        return spans

    @torch.no_grad()
    def logits(self, token_ids: list[int], replays=(), kept_from: int = 0,
               last_rows: int | None = None, images=(), tie_tolerance: float = 0.0,
               flipped=frozenset()) -> torch.Tensor:
        """[T, vocab] next-token logits for every prefix of token_ids (only the last
        `last_rows` rows when given: a long sequence's full logits take T x vocab memory).

        Bounded replay (kv_cache/bounded_replay.py): `replays` are the prefix-cache hits
        the sequence was recomputed from, in order, as (replay start s, hit tokens N).
        Each recomputes the positions from its s on, every window attending nothing
        before s; the compressed latents and index keys of groups that close before N
        are the cache's, written by the computations before it (the first one exact).
        Decoder-side replay: layers after the last kv source (`V41Args.decoder_replay_cut`)
        attend nothing before `kept_from`. Rows before the last replay start (or
        `kept_from`) are not meaningful.

        `images` (PIL images, in prompt order): their spans' embeddings replace the token
        embeddings of the image-token positions, which they must cover exactly.

        Near ties: an indexer's top-k whose margin (the last chosen score minus the first
        passed-over one) is below `tie_tolerance` is a selection fp32 arithmetic may make
        either way; `near_ties` lists them afterwards as `Tie`s (rows that matter only:
        from each pass's start, and before the next pass's hit), and those in `flipped`
        are resolved the other way (the first passed-over position replaces the last
        chosen one)."""
        spans = torch.cat(self.image_spans(images)) if images else None
        passes = [(0, 0), *replays]
        cached = None
        self.near_ties: list[Tie] = []
        self._ties = (tie_tolerance, frozenset(flipped))
        try:
            for number, (start, hit) in enumerate(passes):
                last = number == len(passes) - 1
                # The rows that matter: from the pass's start, and before the next hit.
                self._pass = (number, start, None if last else passes[number + 1][1])
                out = self._forward(token_ids, start, max(start, kept_from) if last else start,
                                    (hit, cached) if hit else None, last_rows if last else 1,
                                    spans)
                cached = self._compressed
        finally:
            self._ties = NO_TIES
        return out

    def _forward(self, token_ids: list[int], replay_start: int, kept_from: int, cached,
                 last_rows: int | None = None, spans: torch.Tensor | None = None
                 ) -> torch.Tensor:
        a, w = self.args, self.w
        ids = torch.tensor(token_ids)
        pos = torch.arange(len(token_ids))
        cut = a.decoder_replay_cut
        self._first_key = {layer: kept_from if cut is not None and layer > cut
                           else replay_start for layer in range(a.num_hidden_layers)}
        self._cached = cached
        x = w["embed.weight"][ids]
        if spans is not None:
            image_rows = (ids == IMAGE_TOKEN_ID).nonzero()[:, 0]
            assert len(image_rows) == len(spans), (len(image_rows), len(spans))
            x = x.index_copy(0, image_rows, spans)
        copies = x[:, None, :].expand(-1, a.hc_mult, -1).clone()
        self._compressed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._selection: dict[int, torch.Tensor] = {}
        self._candidates = None
        pre = None
        self.streams: dict[int, torch.Tensor] = {}  # DSpark's inputs
        for layer in range(a.num_hidden_layers):
            p = f"layers.{layer}."
            if a.dspark_stages and layer in a.dspark_targets:
                self.streams[layer] = entry_stream(copies)
            engram = None
            if layer in a.engram_layer_ids:
                engram = lambda c, layer=layer: self._engram(layer, c, ids)  # noqa: E731
            copies, pre = decoder_step(
                copies, pre, mixes=lambda c, boundary, p=p: self._mixes(c, f"{p}hc_{boundary}"),
                engram=engram,
                attention=lambda x, layer=layer: self._attention(layer, x, pos),
                attn_norm=lambda x, p=p: self._norm(x, p + "attn_norm.weight"),
                ffn=lambda x, p=p: self._moe(p + "ffn.", x, ids),
                ffn_norm=lambda x, p=p: self._norm(x, p + "ffn_norm.weight"))
        h = self._norm(hc_collapse(copies, pre), "norm.weight")
        return h[-(last_rows or len(h)):] @ w["head.weight"].T

    @torch.no_grad()
    def dspark(self, token_ids: list[int], anchors: list[int], replays=(),
               kept_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """DSpark's greedy drafts and confidences [A, dspark_block_size] at each anchor
        position P in `anchors`: the token at P is the anchor (the one just sampled), the
        tokens before it the context, computed as `logits` computes them (`replays`,
        `kept_from`)."""
        a, w = self.args, self.w
        self.logits(token_ids, replays, kept_from, last_rows=1)
        positions = torch.tensor(anchors)
        hidden = self.dspark_hidden(token_ids, positions, self.streams)
        last = f"mtp.{a.dspark_stages - 1}."
        base = self._norm(hidden, last + "norm.weight") @ w["head.weight"].T
        return markov_draft(base, hidden, torch.tensor(token_ids)[positions],
                            w[last + "markov_head.embed.weight"],
                            w[last + "markov_head.head.weight"],
                            w[last + "confidence_head.proj.weight"])

    def dspark_hidden(self, token_ids: list[int], anchors: torch.Tensor,
                      streams: dict[int, torch.Tensor]) -> torch.Tensor:
        """Pre-norm hidden [A, N, H] of the draft blocks at `anchors`, from the target's
        entry streams over token_ids (all blocks in one pass, each seeing its own)."""
        a, w = self.args, self.w
        main_x = self._norm(torch.cat([streams[t] for t in a.dspark_targets], -1)
                            @ w["mtp.0.main_proj.weight"].T, "mtp.0.main_norm.weight")
        ids, positions = block_inputs(torch.tensor(token_ids)[anchors], anchors,
                                      a.dspark_block_size, a.dspark_noise_token_id)
        x = w["embed.weight"][ids.flatten()]
        copies = x[:, None, :].expand(-1, a.hc_mult, -1).clone()
        pre = None
        top_k = a.dspark["dspark_num_experts_per_tok"]
        for stage in range(a.dspark_stages):
            p = f"mtp.{stage}."
            copies, pre = decoder_step(
                copies, pre, mixes=lambda c, boundary, p=p: self._mixes(c, f"{p}hc_{boundary}"),
                engram=None,
                attention=lambda x, p=p: self._block_attention(p + "attn.", x, main_x, positions),
                attn_norm=lambda x, p=p: self._norm(x, p + "attn_norm.weight"),
                ffn=lambda x, p=p: self._moe(p + "ffn.", x, ids.flatten(), top_k),
                ffn_norm=lambda x, p=p: self._norm(x, p + "ffn_norm.weight"))
        return hc_collapse(copies, pre).view(*ids.shape, -1)

    def _block_attention(self, p: str, x: torch.Tensor, main_x: torch.Tensor,
                         positions: torch.Tensor) -> torch.Tensor:
        """A stage's attention: each block's queries see the `sliding_window` context
        latents (from main_x) before its anchor and all of its own latents."""
        a, w = self.args, self.w
        inv = self.inv_freq[0]
        blocks, n = positions.shape
        flat = positions.flatten()
        _, q = self._queries(p, x, flat, inv)
        context_pos = torch.arange(main_x.shape[0])[None, :]
        anchor = positions[:, :1]
        sees_context = (context_pos < anchor) & (context_pos >= anchor - a.sliding_window)
        block_of_key = torch.arange(blocks).repeat_interleave(n)
        sees_own = block_of_key[None, :] == torch.arange(blocks)[:, None]
        mask = torch.cat([sees_context, sees_own], 1).repeat_interleave(n, 0)
        keys = torch.cat([self._latent(p, main_x, context_pos[0], inv),
                          self._latent(p, x, flat, inv)])
        o = sink_attention(q, keys, mask, w[p + "attn_sink"], a.head_dim ** -0.5)
        return self._output(p, o, flat, inv)

    def _queries(self, p: str, x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor):
        """(qr, the RoPE'd queries [T, heads, head_dim]) of the attention at `p`."""
        a, w = self.args, self.w
        qr = self._norm(x @ w[p + "wq_a.weight"].T, p + "q_norm.weight")
        q = (qr @ w[p + "wq_b.weight"].T).view(len(pos), a.num_attention_heads, a.head_dim)
        return qr, apply_rope(q, pos, inv)

    def _latent(self, p: str, x: torch.Tensor, pos: torch.Tensor,
                inv: torch.Tensor) -> torch.Tensor:
        w = self.w
        return apply_rope(self._norm(x @ w[p + "wkv.weight"].T, p + "kv_norm.weight"), pos, inv)

    def _output(self, p: str, o: torch.Tensor, pos: torch.Tensor,
                inv: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE, grouped wo_a, wo_b."""
        w = self.w
        o = apply_rope(o, pos, inv, inverse=True)
        grouped = grouped_output(o, w[p + "wo_a.weight"], self.args.o_groups)
        return grouped @ w[p + "wo_b.weight"].T

    def _attention(self, layer: int, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        a, w = self.args, self.w
        p = f"layers.{layer}.attn."
        ratio = a.ratio(layer)
        inv = self.inv_freq[ratio]
        qr, q = self._queries(p, x, pos, inv)
        query, key = pos[:, None], pos[None, :]
        keys = self._latent(p, x, pos, inv)
        window = (key <= query) & (key > query - a.sliding_window)
        mask = window & (key >= self._first_key[layer])
        if ratio:
            if layer in a.kv_source_layer_ids:
                self._compressed[layer] = self._compress(layer, x, len(pos))
            compressed, index_keys = self._compressed[a.kv_source(layer)]
            if layer in a.index_source_layer_ids:
                self._selection[layer] = self._index(layer, qr, x, pos, index_keys)
            if compressed.shape[0]:
                keys = torch.cat([compressed, keys])
                mask = torch.cat([self._selection[a.index_source(layer)], mask], dim=1)
        o = sink_attention(q, keys, mask, w[p + "attn_sink"], a.head_dim ** -0.5)
        return self._output(p, o, pos, inv)

    def _compress(self, layer: int, x: torch.Tensor, length: int):
        """(RoPE'd compressed latents, index keys) of every closed group; under replay, the
        cached hit's own for the groups that close before its end."""
        latents, index_keys = self._compress_here(layer, x, length)
        if self._cached is not None:
            cached_tokens, exact = self._cached
            n = cached_tokens // self.args.ratio(layer)
            latents, index_keys = latents.clone(), index_keys.clone()
            latents[:n], index_keys[:n] = exact[layer][0][:n], exact[layer][1][:n]
        return latents, index_keys

    def _compress_here(self, layer: int, x: torch.Tensor, length: int):
        a, w = self.args, self.w
        p = f"layers.{layer}.attn."
        ratio = a.ratio(layer)
        kv = x @ w[p + "compressor.wkv.weight"].T
        groups = length // ratio
        if ratio == 2:
            score = x @ w[p + "compressor.wgate.weight"].T
            pairs = slice(0, 2 * groups, 2), slice(1, 2 * groups, 2)
            kv = pool_pair(torch.stack([kv[s] for s in pairs]),
                               torch.stack([score[s] for s in pairs]))
        latent = self._norm(kv, p + "compressor.norm.weight")
        start = torch.arange(groups) * ratio
        inv = self.inv_freq[ratio]
        index_keys = self._norm(latent @ w[p + "indexer.wk.weight"].T, p + "indexer.k_norm.weight")
        stored = [apply_rope(latent, start, inv), apply_rope(index_keys, start, inv)]
        for i, record in enumerate(self.records):
            if record is not None:  # as the cache stores it: fp32 rows, encoded
                stored[i] = record.decode(record.encode(stored[i].float()), stored[i].dtype)
        return tuple(stored)

    def _index(self, layer: int, qr: torch.Tensor, x: torch.Tensor, pos: torch.Tensor,
               index_keys: torch.Tensor) -> torch.Tensor:
        """Boolean [T, groups]: which compressed positions each query attends to."""
        a, w = self.args, self.w
        p = f"layers.{layer}.attn.indexer."
        ratio = a.ratio(layer)
        q = (qr @ w[p + "wq_b.weight"].T).view(len(pos), a.index_n_heads, a.index_head_dim)
        q = apply_rope(q, pos, self.inv_freq[ratio])
        weights = (x @ w[p + "weights_proj.weight"].T) * (a.index_head_dim * a.index_n_heads) ** -0.5
        scores = index_scores(q, weights, index_keys)
        n_visible = (pos + 1) // ratio
        allowed = torch.arange(index_keys.shape[0])[None, :] < n_visible[:, None]
        if layer == a.candidate_source_layer_id:
            self._candidates = candidate_blocks(scores, n_visible, a.candidate_block_size,
                                                    a.candidate_topk_blocks)
        if a.reads_candidates(layer):
            allowed &= self._candidates
        return self._select(layer, scores, allowed)

    def _select(self, layer: int, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """select_topk, recording near ties and resolving those in `flipped` the other way."""
        k = self.args.index_topk
        selection = select_topk(scores, allowed, k)
        tolerance, flipped = self._ties
        if not tolerance or scores.shape[1] <= k:
            return selection
        number, first, before = self._pass
        masked = scores.masked_fill(~allowed, float("-inf"))
        order = stable_topk(masked, k + 1)
        inside, outside = masked.gather(1, order[:, k - 1:k + 1]).unbind(1)
        margin = inside - outside
        # Exact zeros (every head's ReLU closed) tie in any precision, and resolve alike.
        near = ((outside > float("-inf")) & (margin < tolerance)
                & ((inside != 0) | (outside != 0)))
        rows = near.nonzero()[:, 0].tolist()
        for row in rows:
            if row < first or (before is not None and row >= before):
                continue
            tie = Tie(number, layer, row, margin[row].item())
            self.near_ties.append(tie)
            if tie.key in flipped:
                selection[row, order[row, k - 1]] = False
                selection[row, order[row, k]] = True
        return selection

    def _engram(self, layer: int, copies: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        a, w = self.args, self.w
        p = f"layers.{layer}.engram."
        current = history_ids(self.compressed_ids[ids], ids)
        history = torch.full((len(ids), a.engram_max_ngram_size), NO_TOKEN)
        for back in range(a.engram_max_ngram_size):
            history[back:, back] = current[: len(ids) - back]
        rows = self.hashing.rows(layer, history)
        projected = w[p + "embed.weight"][rows].flatten(1) @ w[p + "wkv.weight"].T
        hc, h = a.hc_mult, a.hidden_size
        keys = projected[:, : hc * h].view(-1, hc, h)
        return engram_gate(copies, keys, projected[:, hc * h:], w[p + "q_weight"],
                           w[p + "k_weight"], a.rms_norm_eps, dead=ids == IMAGE_TOKEN_ID)

    def _moe(self, p: str, x: torch.Tensor, ids: torch.Tensor,
             top_k: int | None = None) -> torch.Tensor:
        a, w = self.args, self.w
        bias = selection_bias(w[p + "gate.bias"], w.get(p + "gate.bias_vl"), routed_as_image(ids))
        weights, chosen = route(x @ w[p + "gate.weight"].T, bias,
                                top_k or a.num_experts_per_tok, a.routed_scaling_factor)

        def expert(prefix: str, rows: torch.Tensor) -> torch.Tensor:
            gate = rows @ w[prefix + "w1.weight"].T
            up = rows @ w[prefix + "w3.weight"].T
            return clamped_swiglu(gate, up, a.swiglu_limit) @ w[prefix + "w2.weight"].T

        out = expert(p + "shared_experts.", x)
        for e in chosen.unique().tolist():
            tokens, slot = (chosen == e).nonzero(as_tuple=True)
            routed = expert(f"{p}experts.{e}.", x[tokens]) * weights[tokens, slot, None].to(x.dtype)
            out = out.index_add(0, tokens, routed)
        return out
