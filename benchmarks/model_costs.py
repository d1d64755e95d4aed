"""What one token costs each model of benchmarks/throughput.py, from its config alone:
parameters, KV-cache bytes and FLOPs. The throughput figures are read against these, so
they are kept as small formulas that tests/benchmarks/test_model_costs.py checks against
hand counts. FLOPs count 2 per multiply-add; elementwise work (norms, RoPE, softmax,
pooling, activations, the hyper-connection mixing of copies) is left out of both models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from vllm_deepinfer.checkpoint.layout import backbone_layout
from vllm_deepinfer.model.deepseek_v41.args import V41Args

COMPRESSOR_WEIGHTS = (".attn.compressor.", ".attn.indexer.wk.")
"""The compressor's projections (`indexer.wk` makes the index key of each closed group).
Their cost goes under attention: `indexer.wk` runs once per group, not per token."""
ELEMENTWISE_WEIGHTS = (".engram.q_weight", ".engram.k_weight")
"""2-D, but per-copy scales of Engram's gate, not matrices multiplied by the input."""


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int  # touched per token: of the routed experts only top-k of n
    lookup: int  # tables read by token id (embeddings, Engram), in both counts above

    @property
    def matmul(self) -> int:
        """Active weights multiplied per token: the compute the two models should share."""
        return self.active - self.lookup


@dataclass(frozen=True)
class KVBytes:
    per_token: int  # one token's rows in every cache the model keeps
    beyond_windows: int  # what a token adds once the context outgrows every sliding window


@dataclass(frozen=True)
class FlopCount:
    matmul: int  # weight matrices outside the head, per token
    attention: dict[int, int]  # context length -> attention work of a token at that context
    head: int  # the vocabulary projection


def is_lookup(name: str) -> bool:
    return name.endswith("embed.weight") or name == "model.embed_tokens.weight"


# ----------------------------------------------------------------------------- V4.1


def v41_args(text_config: dict) -> V41Args:
    return V41Args.from_hf_config(SimpleNamespace(**text_config))


def v41_tensors(a: V41Args) -> dict[str, tuple[tuple[int, ...], float]]:
    """Backbone tensor -> (logical shape, share of tokens it serves): top-k of n for the
    routed experts, all for the rest. Logical shapes, so quantized files count the same;
    the DSpark draft stages (mtp.*) do not run without speculation and are left out."""
    expert_share = a.num_experts_per_tok / a.n_routed_experts
    return {
        name: (spec.shape, expert_share if ".ffn.experts." in name else 1.0)
        for name, spec in backbone_layout(a, False).items()
    }


def v41_param_count(a: V41Args) -> ParamCount:
    tensors = v41_tensors(a)
    total = sum(math.prod(shape) for shape, _ in tensors.values())
    active = round(sum(math.prod(shape) * share for shape, share in tensors.values()))
    lookup = sum(math.prod(shape) for name, (shape, _) in tensors.items() if is_lookup(name))
    return ParamCount(total, active, lookup)


def v41_kv_bytes(a: V41Args, dtype_bytes: int) -> KVBytes:
    """The paged caches of vllm_deepinfer/kv_cache/specs.py, per token: every layer's
    window latents; per kv source its compressed latents and index keys (one row per
    `ratio` tokens) and, at ratio 2, the fp32 [kv | gate] rows of the open group; Engram's
    fp32 token history. Only the compressed rows are kept for the whole context."""
    window = a.num_hidden_layers * a.head_dim * dtype_bytes
    compressed = 0
    for source in a.kv_source_layer_ids:
        ratio = a.ratio(source)
        compressed += (a.head_dim + a.index_head_dim) * dtype_bytes // ratio
        if ratio == 2:
            window += 2 * a.head_dim * 4
    window += len(a.engram_layer_ids) * 4
    return KVBytes(window + compressed, compressed)


def v41_attention_flops(a: V41Args, context: int) -> int:
    """A token that sees `context` positions: per layer, its heads attend over the window
    and (compressed layers) the top-k compressed latents, key = value; index sources score
    every visible compressed position, sum_h w_h relu(q_h . k), which upstream and the
    plugin do densely even where candidate blocks would allow fewer; kv sources run the
    compressor (wkv, wgate at ratio 2, per token; the index-key projection per group)."""
    flops = 0
    for layer in range(a.num_hidden_layers):
        ratio = a.ratio(layer)
        keys = min(context, a.sliding_window)
        if ratio:
            keys += min(a.index_topk, context // ratio)
        flops += 2 * 2 * a.num_attention_heads * a.head_dim * keys
        if layer in a.index_source_layer_ids:
            flops += context // ratio * 2 * a.index_n_heads * (a.index_head_dim + 1)
        if layer in a.kv_source_layer_ids:
            projections = 2 if ratio == 2 else 1
            flops += 2 * a.hidden_size * a.head_dim * projections
            flops += 2 * a.head_dim * a.index_head_dim // ratio
    return flops


def v41_flops(a: V41Args, contexts: list[int]) -> FlopCount:
    tensors = v41_tensors(a)
    matmul = sum(
        math.prod(shape) * share
        for name, (shape, share) in tensors.items()
        if len(shape) == 2
        and not is_lookup(name)
        and name != "head.weight"
        and not any(part in name for part in COMPRESSOR_WEIGHTS + ELEMENTWISE_WEIGHTS)
    )
    return FlopCount(
        round(2 * matmul),
        {c: v41_attention_flops(a, c) for c in contexts},
        2 * a.vocab_size * a.hidden_size,
    )


# ---------------------------------------------------------------------------- Llama


def llama_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a HF LlamaForCausalLM checkpoint (untied embeddings)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "lm_head.weight": (config["vocab_size"], h),
        "model.norm.weight": (h,),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
    return shapes


def llama_param_count(config: dict) -> ParamCount:
    """A dense model: every parameter is active for every token."""
    shapes = llama_shapes(config)
    total = sum(math.prod(s) for s in shapes.values())
    return ParamCount(total, total, math.prod(shapes["model.embed_tokens.weight"]))


def llama_kv_bytes(config: dict, dtype_bytes: int) -> KVBytes:
    """A key and a value per layer and kv head, for every token of the context."""
    per_token = (
        2
        * config["num_hidden_layers"]
        * config["num_key_value_heads"]
        * config["head_dim"]
        * dtype_bytes
    )
    return KVBytes(per_token, per_token)


def llama_flops(config: dict, contexts: list[int]) -> FlopCount:
    """Attention: q.k and the weighted sum of values, per head, over every position."""
    matmul = sum(
        math.prod(shape)
        for name, shape in llama_shapes(config).items()
        if len(shape) == 2 and not is_lookup(name) and name != "lm_head.weight"
    )
    per_position = (
        2 * 2 * config["num_hidden_layers"] * config["num_attention_heads"] * config["head_dim"]
    )
    return FlopCount(
        2 * matmul,
        {c: per_position * c for c in contexts},
        2 * config["vocab_size"] * config["hidden_size"],
    )
