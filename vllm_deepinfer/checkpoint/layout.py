"""The release checkpoint's tensor layout, derived from the config: every DeepSeek-native
name, its logical shape and its storage format (formats.py). The checkpoint writer, the
loader's missing/extra/shape checks and the full-size layout test all read it from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_deepinfer.checkpoint.formats import BF16, F32, FORMATS, FP8_ROWS, MXFP4, MXFP8

if TYPE_CHECKING:  # the layout reads the model's arguments; the model imports the loader
    from vllm_deepinfer.model.deepseek_v41.args import V41Args


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    fmt: str

    def stored(self, name: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The file tensors (name -> (shape, dtype)) that hold this logical tensor."""
        return FORMATS[self.fmt].stored(name, self.shape)


# Top-level names of the vision-language release that the text model does not read.
VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


def is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def is_backbone(name: str) -> bool:
    """A tensor the text model reads (not a DSpark stage, not the vision tower)."""
    return not name.startswith("mtp.") and not is_vision(name)


def _block(
    a: V41Args, prefix: str, layer: int | None, n_experts: int, quantized: bool
) -> dict[str, TensorSpec]:
    """One decoder block; `layer` is None for DSpark stages (SWA-only, no sources)."""
    q8 = MXFP8 if quantized else BF16
    q4 = MXFP4 if quantized else BF16
    H, D, Q, hc = a.hidden_size, a.head_dim, a.q_lora_rank, a.hc_mult
    mixes = (2 + hc) * hc
    inter = a.moe_intermediate_size
    t: dict[str, TensorSpec] = {}
    for boundary in ("attn", "ffn"):
        t[f"hc_{boundary}_fn"] = TensorSpec((mixes, hc * H), F32)
        t[f"hc_{boundary}_base"] = TensorSpec((mixes,), F32)
        t[f"hc_{boundary}_scale"] = TensorSpec((3,), F32)
    t["attn_norm.weight"] = TensorSpec((H,), BF16)
    t["ffn_norm.weight"] = TensorSpec((H,), BF16)
    t["attn.wq_a.weight"] = TensorSpec((Q, H), q8)
    t["attn.wkv.weight"] = TensorSpec((D, H), q8)
    t["attn.q_norm.weight"] = TensorSpec((Q,), BF16)
    t["attn.kv_norm.weight"] = TensorSpec((D,), BF16)
    t["attn.wq_b.weight"] = TensorSpec((a.num_attention_heads * D, Q), q8)
    t["attn.wo_a.weight"] = TensorSpec(
        (a.o_groups * a.o_lora_rank, a.num_attention_heads * D // a.o_groups), q8
    )
    t["attn.wo_b.weight"] = TensorSpec((H, a.o_groups * a.o_lora_rank), q8)
    t["attn.attn_sink"] = TensorSpec((a.num_attention_heads,), F32)
    if layer is not None and layer in a.kv_source_layer_ids:
        t["attn.compressor.wkv.weight"] = TensorSpec((D, H), BF16)
        if a.ratio(layer) == 2:
            t["attn.compressor.wgate.weight"] = TensorSpec((D, H), BF16)
        t["attn.compressor.norm.weight"] = TensorSpec((D,), BF16)
    if layer is not None and layer in a.index_source_layer_ids:
        t["attn.indexer.wq_b.weight"] = TensorSpec((a.index_n_heads * a.index_head_dim, Q), q8)
        t["attn.indexer.weights_proj.weight"] = TensorSpec((a.index_n_heads, H), BF16)
        if layer in a.kv_source_layer_ids:
            t["attn.indexer.wk.weight"] = TensorSpec((a.index_head_dim, D), BF16)
            t["attn.indexer.k_norm.weight"] = TensorSpec((a.index_head_dim,), BF16)
    if layer is not None and layer in a.engram_layer_ids:
        rows = a.engram_num_embeddings[a.engram_layer_ids.index(layer)]
        t["engram.embed.weight"] = TensorSpec(
            (rows, a.engram_head_dim), FP8_ROWS if quantized else BF16
        )
        t["engram.wkv.weight"] = TensorSpec(
            ((hc + 1) * H, a.engram_columns * a.engram_head_dim), q8
        )
        t["engram.q_weight"] = TensorSpec((hc, H), BF16)
        t["engram.k_weight"] = TensorSpec((hc, H), BF16)
    t["ffn.gate.weight"] = TensorSpec((n_experts, H), BF16)
    t["ffn.gate.bias"] = TensorSpec((n_experts,), F32)
    if a.vision_language:
        t["ffn.gate.bias_vl"] = TensorSpec((n_experts,), F32)
    for e in range(n_experts):
        t[f"ffn.experts.{e}.w1.weight"] = TensorSpec((inter, H), q4)
        t[f"ffn.experts.{e}.w3.weight"] = TensorSpec((inter, H), q4)
        t[f"ffn.experts.{e}.w2.weight"] = TensorSpec((H, inter), q4)
    shared = inter * a.n_shared_experts
    t["ffn.shared_experts.w1.weight"] = TensorSpec((shared, H), q8)
    t["ffn.shared_experts.w3.weight"] = TensorSpec((shared, H), q8)
    t["ffn.shared_experts.w2.weight"] = TensorSpec((H, shared), q8)
    return {f"{prefix}{name}": spec for name, spec in t.items()}


def backbone_layout(a: V41Args, quantized: bool) -> dict[str, TensorSpec]:
    """Every tensor the target model (no DSpark stages) reads."""
    t = {
        "embed.weight": TensorSpec((a.vocab_size, a.hidden_size), BF16),
        "head.weight": TensorSpec((a.vocab_size, a.hidden_size), BF16),
        "norm.weight": TensorSpec((a.hidden_size,), BF16),
    }
    for layer in range(a.num_hidden_layers):
        t.update(_block(a, f"layers.{layer}.", layer, a.n_routed_experts, quantized))
    return t


def dspark_layout(a: V41Args, quantized: bool) -> dict[str, TensorSpec]:
    """The DSpark draft stages `mtp.*`, which share embedding and head with the target."""
    d, H = a.dspark, a.hidden_size
    stages = a.num_nextn_predict_layers
    if not stages:
        return {}
    t: dict[str, TensorSpec] = {}
    for s in range(stages):
        t.update(_block(a, f"mtp.{s}.", None, d["dspark_n_routed_experts"], quantized))
    targets = len(d["dspark_target_layer_ids"])
    rank = d["dspark_markov_rank"]
    last = f"mtp.{stages - 1}."
    t["mtp.0.main_proj.weight"] = TensorSpec((H, targets * H), MXFP8 if quantized else BF16)
    t["mtp.0.main_norm.weight"] = TensorSpec((H,), BF16)
    t[f"{last}norm.weight"] = TensorSpec((H,), BF16)
    t[f"{last}markov_head.embed.weight"] = TensorSpec((a.vocab_size, rank), BF16)
    t[f"{last}markov_head.head.weight"] = TensorSpec((a.vocab_size, rank), BF16)
    t[f"{last}confidence_head.proj.weight"] = TensorSpec((1, H + rank), F32)
    return t


def vision_layout(a: V41Args) -> dict[str, TensorSpec]:
    """The vision tower, aligner and image-span vectors of the vision-language release,
    named as upstream vLLM's loader expects them; never quantized."""
    v = a.vision
    if not a.vision_language:
        return {}
    dim, inter, patch, down = (
        v["vision_dim"],
        v["vision_inter_dim"],
        v["vision_patch_size"],
        v["vision_downsample_ratio"],
    )
    H = a.hidden_size
    t = {
        "vision.patch_embed.proj.weight": TensorSpec((dim, 3 * patch * patch), BF16),
        "vision.patch_embed.proj.bias": TensorSpec((dim,), BF16),
        "vision.norm.weight": TensorSpec((dim,), BF16),
    }
    for i in range(v["vision_n_layers"]):
        p = f"vision.blocks.{i}."
        t.update(
            {
                p + "norm1.weight": TensorSpec((dim,), BF16),
                p + "norm2.weight": TensorSpec((dim,), BF16),
                p + "attn.wqkv.weight": TensorSpec((3 * dim, dim), BF16),
                p + "attn.wqkv.bias": TensorSpec((3 * dim,), BF16),
                p + "attn.wo.weight": TensorSpec((dim, dim), BF16),
                p + "attn.wo.bias": TensorSpec((dim,), BF16),
                p + "mlp.w1.weight": TensorSpec((2 * inter, dim), BF16),
                p + "mlp.w2.weight": TensorSpec((dim, inter), BF16),
            }
        )
    t.update(
        {
            "aligner.w1.weight": TensorSpec((H, dim * down * down), BF16),
            "aligner.w1.bias": TensorSpec((H,), BF16),
            "aligner.w2.weight": TensorSpec((H, H), BF16),
            "aligner.w2.bias": TensorSpec((H,), BF16),
        }
    )
    for vector in ("image_start", "image_end", "image_newline"):
        t[vector] = TensorSpec((H,), F32)
    return t


def checkpoint_layout(a: V41Args, quantized: bool) -> dict[str, TensorSpec]:
    """Every tensor of the release file: backbone, DSpark stages, vision tower."""
    return {**backbone_layout(a, quantized), **dspark_layout(a, quantized), **vision_layout(a)}


def stored_tensors(layout: dict[str, TensorSpec]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {}
    for name, spec in layout.items():
        out.update(spec.stored(name))
    return out
