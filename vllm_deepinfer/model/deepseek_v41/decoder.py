"""One V4.1 decoder layer on the residual copies: Engram (on its layers), the attention
boundary, then the MoE boundary. `decoder_step` is the layer's order of operations, the
one place it is written: the paged layer runs it on its modules, the dense reference
forward on its own dense sublayers, and the DSpark draft stages (dspark.py) run it on
their blocks."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm

from vllm_deepinfer.determinism import batch_invariant
from vllm_deepinfer.kernels import vllm_kernels
from vllm_deepinfer.kv_cache.bounded_replay import ReplaySettings
from vllm_deepinfer.model.deepseek_v41.args import V41Args
from vllm_deepinfer.model.deepseek_v41.attention import V41Attention
from vllm_deepinfer.model.deepseek_v41.engram import V41Engram
from vllm_deepinfer.model.deepseek_v41.hyper_connections import hc_collapse, hc_mixes, hc_update
from vllm_deepinfer.model.deepseek_v41.moe import V41MoE
from vllm_deepinfer.model.deepseek_v41.parallel import ExpertPlacement

Sublayer = Callable[[torch.Tensor], torch.Tensor]


def decoder_step(
    copies: torch.Tensor,
    pre: torch.Tensor | None,
    *,
    mixes: Callable[[torch.Tensor, str], tuple],
    engram: Sublayer | None,
    attention: Sublayer,
    attn_norm: Sublayer,
    ffn: Sublayer,
    ffn_norm: Sublayer,
    update: Callable[..., torch.Tensor] = hc_update,
) -> tuple[torch.Tensor, torch.Tensor]:
    """copies [T, hc, H] and the previous boundary's `pre` (None before the first layer)
    -> (copies after the layer, this layer's FFN-boundary `pre`).

    V4.1's delayed pre-mix: each sublayer's input collapses the copies with the `pre` of
    the boundary before it; the model's output collapses with the last layer's. `update`
    is the post-mix: `hc_update`, or vLLM's kernel where the layer chose it."""
    if engram is not None:
        copies = engram(copies)
    attn_pre, attn_post, attn_comb = mixes(copies, "attn")
    out = attention(attn_norm(hc_collapse(copies, pre)))
    copies = update(copies, attn_comb, attn_post, out)
    ffn_pre, ffn_post, ffn_comb = mixes(copies, "ffn")
    out = ffn(ffn_norm(hc_collapse(copies, attn_pre)))
    return update(copies, ffn_comb, ffn_post, out), ffn_pre


class V41DecoderLayer(nn.Module):
    def __init__(
        self, a: V41Args, layer: int, prefix: str, vllm_config: VllmConfig, replay: ReplaySettings
    ):
        super().__init__()
        self.a, self.layer = a, layer
        mixes = (2 + a.hc_mult) * a.hc_mult
        for boundary in ("attn", "ffn"):
            for part, shape in (
                ("fn", (mixes, a.hc_mult * a.hidden_size)),
                ("base", (mixes,)),
                ("scale", (3,)),
            ):
                self.register_parameter(
                    f"hc_{boundary}_{part}",
                    nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False),
                )
        self.attn_norm = RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.ffn_norm = RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.attn = V41Attention(a, layer, f"{prefix}.attn", vllm_config, replay)
        if layer < a.num_hidden_layers:
            self.ffn = V41MoE(
                a,
                layer,
                f"{prefix}.ffn",
                ExpertPlacement.of(vllm_config, a.n_routed_experts, balanced=True),
            )
        else:  # a DSpark stage
            self.ffn = V41MoE(
                a,
                layer,
                f"{prefix}.ffn",
                ExpertPlacement.whole(a.dspark["dspark_n_routed_experts"]),
                a.dspark["dspark_num_experts_per_tok"],
            )
        self.engram = (
            V41Engram(a, layer, f"{prefix}.engram") if layer in a.engram_layer_ids else None
        )
        # The hyper-connections' post-mix of both boundaries.
        fits = not batch_invariant.enabled() and vllm_kernels.hc_post_fits(
            vllm_config.model_config.dtype
        )
        self.update = vllm_kernels.hc_post if fits else hc_update

    def mixes(self, copies: torch.Tensor, boundary: str):
        a = self.a
        return hc_mixes(
            copies,
            getattr(self, f"hc_{boundary}_fn"),
            getattr(self, f"hc_{boundary}_base"),
            getattr(self, f"hc_{boundary}_scale"),
            a.hc_eps,
            a.rms_norm_eps,
            a.hc_sinkhorn_iters,
        )

    def forward(
        self,
        copies: torch.Tensor,
        pre: torch.Tensor | None,
        positions: torch.Tensor,
        engram_rows: torch.Tensor | None,
        image_tokens: torch.Tensor,
        vision_routed: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One backbone layer of the paged model (traced: what reads the step's caches
        runs in the attention's and the MoE's layer ops)."""
        engram = None
        if self.engram is not None:
            engram = partial(self.engram, table_rows=engram_rows, image_tokens=image_tokens)
        return decoder_step(
            copies,
            pre,
            mixes=self.mixes,
            engram=engram,
            attention=partial(self.attn, positions=positions),
            attn_norm=self.attn_norm,
            ffn=partial(self.ffn, vision_routed=vision_routed),
            ffn_norm=self.ffn_norm,
            update=self.update,
        )
