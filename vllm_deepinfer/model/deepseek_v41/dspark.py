"""V4.1's DSpark draft (the checkpoint's `mtp.*` stages), as upstream computes it.

The target hands the draft the *entry streams* of its `dspark_target_layer_ids` layers
(the residual copies entering each, averaged over copies, before Engram and norms);
`main_norm(main_proj(concat))` turns them into `main_x`, which reaches the draft only as
the past positions' latents in every stage's own sliding window (written during the
target's step). A draft step runs one block of `dspark_block_size` positions from the
anchor P (one past the last accepted token): P holds the token just sampled, the others
`dspark_noise_token_id`; the block passes non-causally through the stages (V4.1 decoder
layers, SWA only, their own MoE sizes, no Engram), collapses with the last stage's
FFN-boundary pre, and the shared head gives each position's base logits. Drafting is
sequential only in the low-rank Markov bias (each token conditions on the previous
draft token), and the confidence head gives each draft token's acceptance probability.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm

from vllm_deepinfer.determinism import batch_invariant
from vllm_deepinfer.kv_cache.bounded_replay import ReplaySettings
from vllm_deepinfer.kv_cache.paged import PagedStepMetadata
from vllm_deepinfer.model.deepseek_v41.args import V41Args
from vllm_deepinfer.model.deepseek_v41.compilation import compiled_unless_batch_invariant
from vllm_deepinfer.model.deepseek_v41.decoder import V41DecoderLayer, decoder_step
from vllm_deepinfer.model.deepseek_v41.hyper_connections import hc_collapse
from vllm_deepinfer.model.deepseek_v41.layer_ops import register_owner
from vllm_deepinfer.model.deepseek_v41.ops import linear, wide
from vllm_deepinfer.model.deepseek_v41.step import DraftBlock, StepScope


def entry_stream(copies: torch.Tensor) -> torch.Tensor:
    """What a target layer hands the draft: its input copies [T, hc, H], averaged."""
    return copies.mean(1)


def block_inputs(
    anchors: torch.Tensor, first_positions: torch.Tensor, size: int, noise_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, positions), both [B, size]: the anchor, then noise tokens."""
    ids = torch.full(
        (anchors.shape[0], size), noise_token_id, dtype=torch.int64, device=anchors.device
    )
    ids[:, 0] = anchors
    offsets = torch.arange(size, device=anchors.device)
    return ids, first_positions[:, None] + offsets


def markov_draft(
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
    markov_embed: torch.Tensor,
    markov_head: torch.Tensor,
    confidence_proj: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy draft tokens and their confidences, both [B, N], from the block's base
    logits [B, N, V] and pre-norm hidden [B, N, H]: position i adds the Markov bias of the
    token before it (the anchor, then draft token i-1), in the logits' dtype; its
    confidence is sigmoid(proj . [hidden_i ; markov embedding]) in fp32 or wider."""
    tokens, confidences = [], []
    previous = anchors
    for i in range(base_logits.shape[1]):
        m = markov_embed[previous]
        markov_bias = batch_invariant.project(m, markov_head).to(base_logits.dtype)
        logits = base_logits[:, i] + markov_bias
        features = wide(torch.cat([hidden[:, i], m.to(hidden.dtype)], -1))
        confidences.append(
            batch_invariant.pointwise(
                torch.sigmoid, batch_invariant.project(features, wide(confidence_proj))
            )[:, 0]
        )
        previous = logits.argmax(-1)
        tokens.append(previous)
    return torch.stack(tokens, 1), torch.stack(confidences, 1)


@support_torch_compile(
    dynamic_arg_dims={"embeddings": 0, "positions": 0},
    enable_if=compiled_unless_batch_invariant,
)
class V41DSpark(nn.Module):
    """The draft stages and heads; embedding and LM head are the target's. vLLM compiles
    the stages (`forward`) as a graph of their own, apart from the target's: the context
    read and attention of each stage is its opaque op (`attend_block`)."""

    def __init__(self, a: V41Args, replay: ReplaySettings, *, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.a = a
        H, r, n = a.hidden_size, a.dspark["dspark_markov_rank"], a.num_hidden_layers
        self.main_proj = linear(len(a.dspark_targets) * H, H, f"{prefix}.main_proj", quantized=True)
        self.main_norm = RMSNorm(H, eps=a.rms_norm_eps)
        self.layers = nn.ModuleList(
            V41DecoderLayer(a, n + s, f"{prefix}.layers.{n + s}", vllm_config, replay)
            for s in range(a.dspark_stages)
        )
        self.norm = RMSNorm(H, eps=a.rms_norm_eps)
        self.markov_embed = nn.Parameter(torch.empty(a.vocab_size, r), requires_grad=False)
        self.markov_head = nn.Parameter(torch.empty(a.vocab_size, r), requires_grad=False)
        self.confidence = nn.Parameter(
            torch.empty(1, H + r, dtype=torch.float32), requires_grad=False
        )
        # Each stage's window metadata of the target's last step (the stages' windows
        # may sit in different KV cache groups): what the draft after it reads.
        self.step_metadata: list[PagedStepMetadata | None] = []
        self.block: DraftBlock | None = None  # the draft step `forward` runs
        self.scope: StepScope | None = None  # the target model's (model.py)
        self.op_name = register_owner(prefix, self)
        # Steps whose context the layer op stored: the op's declared write, which keeps
        # it in the compiled graph (nothing else reads what it stores).
        self.register_buffer("stored_steps", torch.zeros(1, dtype=torch.int64), persistent=False)

    def context_latents(self, streams: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each stage's window latents [stages, T, D] of main_x at the target's step
        tokens, from the target layers' entry streams [T, targets * H]. Traced into the
        target's graph (Inductor fuses it with the step); the layer op only writes them."""
        main_x = self.main_norm(self.main_proj(streams))
        return torch.stack([layer.attn._latent(main_x, positions) for layer in self.layers])

    def store_context_step(
        self, latents: torch.Tensor, positions: torch.Tensor, stored: torch.Tensor
    ) -> None:
        """The layer op (layer_ops.py) at the end of the target's step: the stages'
        latents [stages, T, D] of the rows the step computed there (the kept ones after
        decoder-side replay's cut, whose windows are all a draft reads)."""
        ctx, kept = self.scope.rows(self.a.num_hidden_layers, positions)
        if ctx.batch is not None:
            if kept is not None and kept.numel() == 0:
                return  # no row of this step reaches a draft
            latents = latents[:, : ctx.batch.num_tokens] if kept is None else latents[:, kept]
        self.store_context(latents, kept)
        stored.add_(1)

    def store_context(self, latents: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Each stage's window gets its latents [stages, T, D] at the step's tokens
        (`rows` of them, None for all). Rejected draft rows are written too; no draft
        block reads them (they lie at or past its anchor)."""
        self.step_metadata = [layer.attn.window.metadata() for layer in self.layers]
        if self.step_metadata[0] is None:
            return
        for layer, md, latent in zip(self.layers, self.step_metadata, latents):
            slots = md.slot_mapping if rows is None else md.slot_mapping[rows]
            layer.attn.window.write(md, slots, latent)

    def forward(
        self, embeddings: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks' embeddings [B*N, H] at their positions [B*N] -> (pre-norm hidden,
        normed hidden), both [B*N, H]: the stages, the collapse, the final norm. The
        blocks (`self.block`) are set before the call."""
        copies = embeddings[:, None, :].expand(-1, self.a.hc_mult, -1).contiguous()
        pre = None
        for stage, layer in enumerate(self.layers):
            copies, pre = decoder_step(
                copies,
                pre,
                mixes=layer.mixes,
                engram=None,
                attention=partial(
                    layer.attn.block_forward,
                    positions=positions,
                    stage=stage,
                    draft_name=self.op_name,
                ),
                attn_norm=layer.attn_norm,
                ffn=layer.ffn,
                ffn_norm=layer.ffn_norm,
                update=layer.update,
            )
        hidden = hc_collapse(copies, pre)
        return hidden, self.norm(hidden)

    def attend_block(
        self, stage: int, q: torch.Tensor, own: torch.Tensor, out: torch.Tensor
    ) -> None:
        """The layer op (layer_ops.py) of a stage's attention over `self.block`, reading
        the window the target's last step wrote; none in warm-up runs (no block, no caches
        bound: `out` stays zeros)."""
        window_md = self.step_metadata[stage] if self.step_metadata else None
        if self.block is None or window_md is None:
            return
        self.layers[stage].attn.attend_block(q, own, self.block, window_md, out)
