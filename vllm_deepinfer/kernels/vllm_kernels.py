"""vLLM's fused DeepSeek V4 CPU kernels (`torch.ops._C`) for the parts of V4.1 they
compute exactly as the plugin's torch code does: the hyper-connection post-mix and the
router's biased top-k. Each has a `fits` test, decided once when a layer is built (never
inside the compiled graph), and a call with the plugin's signature and return types, so
a layer swaps one for the other. Twins: `hc_update` (hyper_connections.py) and `route`
(moe.py); tests/kernels/test_vllm_kernels.py compares them where the machine has the ops.

vLLM loads these only on CPUs with AVX-512 and AVX512_BF16 (`vllm._C`).
DEEPINFER_VLLM_KERNELS=plugin keeps the plugin's path everywhere; batch-invariant mode
keeps it too (its fixed reduction order is what it guarantees), which the layers, above
this package, check."""

from __future__ import annotations

from functools import cache

import torch

from vllm_deepinfer import envs

HC_POST = "hc_post_fused_cpu"
ROUTER_TOPK = "biased_topk_cpu"
HC_POST_DTYPES = (torch.bfloat16, torch.float16)
"""The activations vLLM's hyper-connection post takes (it refuses fp32)."""


@cache
def enabled() -> bool:
    """DEEPINFER_VLLM_KERNELS, read once per process."""
    return envs.load().vllm_kernels == "auto"


def loaded(op: str) -> bool:
    """Whether the `_C` library vLLM loaded on this CPU registers `op`."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    current_platform.import_kernels()
    import vllm._custom_ops  # noqa: F401  (registers the ops' fake kernels for tracing)

    return hasattr(torch.ops._C, op)


def _usable(op: str) -> bool:
    return enabled() and loaded(op)


def hc_post_fits(dtype: torch.dtype) -> bool:
    """Whether vLLM's post-mix computes this model's hyper-connection update."""
    return dtype in HC_POST_DTYPES and _usable(HC_POST)


def hc_post(
    copies: torch.Tensor, comb: torch.Tensor, post: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """copies'[j] = sum_i comb[i, j] * copies[i] + post[j] * out, as `hc_update`, in one
    call; fp32 accumulation, rounded to the copies' dtype once."""
    return torch.ops._C.hc_post_fused_cpu(out, copies, post.float(), comb.float())


@cache
def router_fits(n_experts: int, top_k: int) -> bool:
    """Whether vLLM's biased top-k takes this router's shape: its kernel is specialised
    for DeepSeek V4's expert counts and top-k (64 to 384 experts, top-6 or 8 on this
    build), so one call on a real CPU row says, rather than a list that a new build would
    outdate. The row is made on the CPU whatever device the model is being built on (on
    a meta device, vLLM's fake kernel would accept any shape), and the answer must be
    the top-k of known scores."""
    if not _usable(ROUTER_TOPK) or not 0 < top_k <= n_experts:
        return False
    logits = torch.arange(n_experts, dtype=torch.float32, device="cpu")[None]
    bias = torch.zeros(n_experts, dtype=torch.float32, device="cpu")
    try:
        _, chosen = torch.ops._C.biased_topk_cpu(
            logits, logits, bias, top_k, True, "sqrtsoftplus", 0, 1.0, True
        )
        picked = sorted(chosen[0].tolist())
    except (RuntimeError, NotImplementedError):
        return False
    return picked == list(range(n_experts - top_k, n_experts))


def route(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route` in one call: sqrtsoftplus scores of the fp32 logits [T, E], the [E]
    bias steering selection only, the chosen experts' scores renormalised x scaling.
    Returns (weights fp32, chosen int64), as the plugin's router does."""
    weights, chosen = torch.ops._C.biased_topk_cpu(
        logits, logits, bias, top_k, True, "sqrtsoftplus", 0, scaling, True
    )
    return weights, chosen.long()
