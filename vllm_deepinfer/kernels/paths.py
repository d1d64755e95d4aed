"""Which kernel computes each part of V4.1 on this machine: vLLM's (`torch.ops._C`, the fused
DeepSeek V4 CPU kernels upstream's `models/deepseek_v4/cpu/` calls) or the plugin's.

vLLM loads its V4 kernels only where the CPU has AVX-512 with AVX512_BF16 (`vllm._C`);
elsewhere it loads `_C_AVX512` or `_C_AVX2`, which lack them. A part takes vLLM's kernel
only where the loaded library registers it, the model's dtype and shape fit it, and its
semantics are V4.1's (the layers ask kernels/vllm_kernels.py); every other case runs the
plugin's path and says why. The choice is made once per process and model (`selected`)
and logged once (`log_once`), the model's worker and the benchmarks asking the same
function."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from vllm_deepinfer.kernels import index_topk, rope, sparse_attention, vllm_kernels, weight_gemv
from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)

VLLM, PLUGIN = "vllm", "plugin"


@dataclass(frozen=True)
class Part:
    """One part of the model and the vLLM kernel that computes it upstream."""

    name: str
    vllm_op: str | None
    """The `torch.ops._C` kernel, or None where vLLM has none for it."""
    differs: str | None = None
    """Why vLLM's kernel does not compute V4.1's part; None where it does (checked against
    the plugin's torch code on an AVX-512 + BF16 machine)."""


PARTS = (
    Part("sparse_attention_decode", "flash_mla_with_kvcache_cpu"),
    Part("kv_insert", "fused_qnorm_rope_kv_insert_cpu", "applies a per-head q norm V4.1 dropped"),
    Part(
        "compressor_store",
        "compress_norm_rope_store_cpu",
        "stores no V4.1 index key (the indexer's compressed keys)",
    ),
    Part("indexer_scores", "fp8_paged_mqa_logits_cpu"),
    Part("indexer_topk", "topk_transform_512_cpu"),
    Part(
        "hyper_connection_pre",
        "hc_pre_fused_cpu",
        "mixes with the current boundary's pre; V4.1 delays the pre-mix",
    ),
    Part("hyper_connection_post", "hc_post_fused_cpu"),
    Part("output_projection", "inverse_gptj_rope_o_proj_cpu"),
    Part("router_topk", "biased_topk_cpu"),
    Part(
        "routed_experts",
        "fused_experts_cpu",
        "applies SiLU or gpt-oss's SwiGLU (MXFP4 on AMX only), not V4.1's clamped SwiGLU",
    ),
    Part("quantized_matmul", None),
)
"""The parts vLLM's V4 CPU kernels compute, and the release weights' product."""


@dataclass(frozen=True)
class Model:
    """What decides a fit besides the CPU: the activations' dtype, the router's shape, and
    batch-invariant mode, which keeps the plugin's path."""

    dtype: torch.dtype
    n_experts: int
    top_k: int
    batch_invariant: bool = False


vllm_has = vllm_kernels.loaded


def _vllm_fits(part: Part, model: Model) -> str | None:
    """What runs where the plugin calls vLLM's kernel for `part` on this model; None
    where it does not."""
    if model.batch_invariant:
        return None
    if part.name == "hyper_connection_post" and vllm_kernels.hc_post_fits(model.dtype):
        return "vLLM's hc_post_fused_cpu, both boundaries of every layer"
    if part.name == "router_topk" and vllm_kernels.router_fits(model.n_experts, model.top_k):
        return (
            f"vLLM's biased_topk_cpu ({model.n_experts} experts, top-{model.top_k}); the "
            "plugin's router for image tokens, which route with their own bias"
        )
    return None


def _why_plugin(part: Part, model: Model) -> str:
    if part.vllm_op is None:
        if part.name == "quantized_matmul":
            return _quantized_matmul()
        return "vLLM has no kernel for it"
    if not vllm_has(part.vllm_op):
        why = f"vLLM's {part.vllm_op} is not in the _C library loaded on this CPU"
    elif part.name == "hyper_connection_post":
        why = _unused(model, f"vLLM's {part.vllm_op} takes bf16 or fp16 activations only")
    elif part.name == "router_topk":
        why = _unused(
            model,
            f"vLLM's {part.vllm_op} does not take {model.n_experts} experts with "
            f"top-{model.top_k} on this build",
        )
    elif part.differs:
        why = f"vLLM's {part.vllm_op} {part.differs}"
    else:
        why = f"vLLM's {part.vllm_op} is loaded but not called yet (layouts differ)"
    if part.name in ("sparse_attention_decode", "indexer_scores"):
        return f"{why}; {_sparse_attention('runs')}"
    if part.name == "indexer_topk":
        return f"{why}; {_index_topk()}"
    if part.name == "kv_insert":
        return f"{why}; q norm in torch, {_rope()}, {_sparse_attention('stores the rows')}"
    if part.name == "routed_experts" and weight_gemv.enabled() and weight_gemv.library():
        return f"{why}; the plugin's C kernel runs decode-sized batches (kernels/weight_gemv.py)"
    return why


def _sparse_attention(does: str) -> str:
    if not sparse_attention.enabled():
        return "the torch path runs (DEEPINFER_ATTENTION_KERNEL=torch)"
    if sparse_attention.library() is None:
        return "the torch path runs (the plugin's C kernel could not be built)"
    return (
        f"the plugin's C kernel {does} (kernels/sparse_attention.py) where the caches are "
        "fp32 or bf16, the torch path on quantized global KV"
    )


def _index_topk() -> str:
    if not sparse_attention.enabled():
        return "the torch path selects (DEEPINFER_ATTENTION_KERNEL=torch)"
    if index_topk.library() is None:
        return "the torch path selects (the plugin's C kernel could not be built)"
    return "the plugin's C kernel selects (kernels/index_topk.py)"


def _rope() -> str:
    if rope.library() is None:
        return "RoPE in torch (the plugin's C kernel could not be built)"
    return "RoPE in the plugin's C kernel (kernels/rope.py) for fp32 and bf16 rows"


def _quantized_matmul() -> str:
    if not weight_gemv.enabled():
        return "dequantize-per-tile torch path (DEEPINFER_MX_KERNEL=tiled)"
    if weight_gemv.library() is None:
        return "dequantize-per-tile torch path (the plugin's C kernel could not be built)"
    return (
        f"the plugin's C kernel (kernels/weight_gemv.py) up to {weight_gemv.MAX_ROWS} rows, "
        "the dequantize-per-tile torch path above"
    )


def _unused(model: Model, why: str) -> str:
    if not vllm_kernels.enabled():
        return "DEEPINFER_VLLM_KERNELS=plugin"
    if model.batch_invariant:
        return "batch-invariant mode keeps the plugin's path"
    return why


@cache
def selected(model: Model) -> dict[str, tuple[str, str]]:
    """part -> (VLLM or PLUGIN, what runs and why), for this process's CPU and settings
    and this model."""
    chosen = {}
    for part in PARTS:
        vllm_path = _vllm_fits(part, model)
        chosen[part.name] = (VLLM, vllm_path) if vllm_path else (PLUGIN, _why_plugin(part, model))
    return chosen


def summary(model: Model) -> dict[str, str]:
    """part -> VLLM or PLUGIN: the `kernels` key of the benchmarks' JSON."""
    return {name: path for name, (path, _) in selected(model).items()}


@cache
def log_once(model: Model) -> None:
    capability = torch.backends.cpu.get_cpu_capability()
    logger.info(
        "Kernel paths on this CPU (%s), %s:\n%s",
        capability,
        str(model.dtype).removeprefix("torch."),
        "\n".join(f"  {name}: {path} ({why})" for name, (path, why) in selected(model).items()),
    )
