"""The embedded tiny V4.1-Flash checkpoint: release format, every layer kind, fixed seed.

Ten layers cover what the forty of Flash do: SWA-only layers (0-1), ratio-2 groups with
their own kv sources (2-3, 4-5), a ratio-1 group sharing layer 6's caches (6-9), an index
source that is not a kv source (8) reading layer 6's candidate blocks, Engram on layers 1
and 4, and three DSpark stages. head_dim 512, qk_rope_head_dim 64 and index_head_dim 128
are the real ones; sliding_window 32 and index_topk 16 make windows, top-k and candidate
masking all bite on prompts of about 100 tokens.
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from vllm_deepinfer.checkpoint import tokenizer as tok
from vllm_deepinfer.checkpoint.formats import FORMATS
from vllm_deepinfer.checkpoint.layout import TensorSpec, checkpoint_layout
from vllm_deepinfer.model.deepseek_v41.args import V41Args
from vllm_deepinfer.model.deepseek_v41.engram import EngramHashing, compressed_vocabulary

SEED = 20261130

TEXT_CONFIG = {
    "vocab_size": tok.VOCAB_SIZE,
    "hidden_size": 256,
    "num_hidden_layers": 10,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_lora_rank": 64,
    "o_groups": 2,
    "sliding_window": 32,
    "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1],
    "kv_source_layer_ids": [2, 4, 6],
    "index_source_layer_ids": [2, 4, 6, 8],
    "candidate_source_layer_id": 6,
    "candidate_topk_blocks": 4,
    "candidate_block_size": 8,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_topk": 16,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 16,
                     "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 1048576,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "engram_layer_ids": [1, 4],
    "engram_max_ngram_size": 4,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 1000,
    "engram_pad_token_id": tok.PAD_ID,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": tok.DSPARK_NOISE_TOKEN_ID,
    "dspark_target_layer_ids": [7, 8, 9],
    "dspark_markov_rank": 32,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": tok.BOS_ID,
    "eos_token_id": tok.EOS_ID,
    "pad_token_id": tok.PAD_ID,
}

SECOND_LAYOUT = {
    "num_hidden_layers": 7,
    "sliding_window": 24,
    "compress_ratios": [0, 1, 1, 0, 2, 2, 2],
    "kv_source_layer_ids": [1, 4],
    "index_source_layer_ids": [1, 4, 6],
    "candidate_source_layer_id": 4,
    "engram_layer_ids": [2],
    "dspark_target_layer_ids": [4, 5, 6],
}
"""Another layout for what depends on it (windows, groups, replay bounds): seven layers, a
24-token window (not a whole number of 16-token blocks), a ratio-1 group first (1-2), an
SWA-only layer between the groups (3), a ratio-2 group (4-6) whose kv source is the
candidate source and the decoder-side replay cut, and an index source (6) after it."""

# The vision-language variant's tower: small, but every tensor kind of the release.
VISION_CONFIG = {"model_type": "deepseek_v41_vision", "num_hidden_layers": 2, "hidden_size": 64,
                 "num_attention_heads": 2, "intermediate_size": 128, "patch_size": 14,
                 "downsample_ratio": 2, "rope_theta": 10000.0,
                 # The release's preprocessing limits, scaled down with the tower: images
                 # below 56x56 pixels are enlarged, a span holds at most 64 tokens, wider
                 # than 4:1 is squeezed.
                 "min_pixels": 3136, "max_image_tokens": 64, "max_wh_ratio": 4.0}
TEXT_ONLY_VISION_CONFIG = {"model_type": "deepseek_v41_vision", "num_hidden_layers": 0}

QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                       "scale_fmt": "ue8m0", "weight_block_size": [32, 32],
                       "expert_dtype": "fp4"}


def _complete_text_config(tokenizer_json: str, overrides: dict | None = None) -> dict:
    """TEXT_CONFIG with `overrides`, and the fields that follow from the tokenizer and the
    Engram hashing."""
    text = {**TEXT_CONFIG, **(overrides or {})}
    tokenizer = Tokenizer.from_str(tokenizer_json)
    lookup, count = compressed_vocabulary(tokenizer, text["vocab_size"])
    text["engram_compressed_vocab_size"] = count
    text["engram_num_embeddings"] = [0] * len(text["engram_layer_ids"])
    args = V41Args.from_hf_config(SimpleNamespace(**text))
    hashing = EngramHashing(args, count, int(lookup[text["engram_pad_token_id"]]))
    text["engram_num_embeddings"] = [hashing.rows_needed(layer)
                                     for layer in text["engram_layer_ids"]]
    return text


def _random_tensor(name: str, spec: TensorSpec, gen: torch.Generator,
                   used_ids: torch.Tensor) -> torch.Tensor:
    """Values scaled so activations stay O(1) through the stack and logits are peaked."""
    shape = spec.shape

    def normal(std: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")) or leaf.endswith("norm"):
        return 1.0 + 0.1 * normal()
    if leaf in ("hc_attn_fn", "hc_ffn_fn"):
        return normal(shape[1] ** -0.5)
    if leaf in ("hc_attn_base", "hc_ffn_base"):
        return normal(0.5)
    if leaf in ("hc_attn_scale", "hc_ffn_scale"):
        return 0.5 + torch.rand(shape, generator=gen)
    if leaf == "attn_sink":
        return normal()
    if name.endswith("ffn.gate.bias"):
        return normal(0.1)
    if name.endswith("ffn.gate.bias_vl"):
        return normal(0.5)  # large enough that image tokens pick other experts
    if name == "embed.weight" or name.endswith("markov_head.embed.weight"):
        return normal()
    if name == "head.weight":
        # Rows of filler ids stay zero, so greedy text is made of the corpus' tokens.
        head = normal(3.0 * shape[1] ** -0.5)
        unused = torch.ones(shape[0], dtype=torch.bool)
        unused[used_ids] = False
        head[unused] = 0.0
        return head
    if name.endswith("engram.embed.weight"):
        return normal()
    if leaf in ("q_weight", "k_weight"):
        return 1.0 + 0.1 * normal()
    if len(shape) == 2:
        return normal(shape[1] ** -0.5)
    return normal()


def write_checkpoint(out_dir: str, quantized: bool = False, vision: bool = False,
                     text_overrides: dict | None = None) -> str:
    """Writes config, tokenizer and weights; returns out_dir. `vision` writes the
    vision-language variant the release is: a vision tower, image-span vectors and
    `bias_vl` on every MoE layer beside the text model. `text_overrides`: fields of
    TEXT_CONFIG replaced (another layout: SECOND_LAYOUT)."""
    os.makedirs(out_dir, exist_ok=True)
    tokenizer_json = tok.build_tokenizer_json()
    text = _complete_text_config(tokenizer_json, text_overrides)
    config = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": tok.BOS_ID,
        "eos_token_id": tok.EOS_ID,
        "pad_token_id": tok.PAD_ID,
        "tie_word_embeddings": False,
        "text_config": {"model_type": "deepseek_v41_text", **text},
        "vision_config": VISION_CONFIG if vision else TEXT_ONLY_VISION_CONFIG,
    }
    if quantized:
        config["quantization_config"] = QUANTIZATION_CONFIG
    args = V41Args.from_release_config(config)
    vocab = Tokenizer.from_str(tokenizer_json).get_vocab()
    used_ids = torch.tensor(sorted(i for t, i in vocab.items() if t != tok.filler_token(i)))
    gen = torch.Generator().manual_seed(SEED)
    tensors: dict[str, torch.Tensor] = {}
    # The same seed gives the same logical weights in both variants: the quantized file is
    # the bf16 one put through the release's formats.
    stored_as = checkpoint_layout(args, quantized)
    for name, spec in checkpoint_layout(args, quantized=False).items():
        value = _random_tensor(name, spec, gen, used_ids)
        tensors.update(FORMATS[stored_as[name].fmt].write(name, value))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tok.tokenizer_config(), f, indent=2, ensure_ascii=False)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tok.BOS_ID, "eos_token_id": tok.EOS_ID}, f)
    return out_dir


def ensure_checkpoint(out_dir: str) -> str:
    """`out_dir`, with the tiny checkpoint written there first if it holds none."""
    if not os.path.exists(os.path.join(out_dir, "config.json")):
        write_checkpoint(out_dir)
    return out_dir
