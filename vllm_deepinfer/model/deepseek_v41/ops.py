"""Numerics every V4.1 part shares. Each concern's own math lives beside its module
(attention.py, compressor.py, indexer.py, moe.py, engram.py, hyper_connections.py); the
paged vLLM model and the dense reference forward both call it."""
from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import ReplicatedLinear


def wide(x: torch.Tensor) -> torch.Tensor:
    """At least fp32: the reference may run everything in fp64."""
    return x if x.dtype == torch.float64 else x.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = wide(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * wide(weight)
    return y.to(x.dtype)


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest per row, ties to the lower index (ReLU scores tie exactly
    and often; a stable order keeps paged and dense gathers in agreement)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def linear(in_features: int, out_features: int, prefix: str,
           dtype: torch.dtype | None = None) -> ReplicatedLinear:
    """V4.1's projections: no bias, whole on every rank."""
    return ReplicatedLinear(in_features, out_features, bias=False, params_dtype=dtype,
                            prefix=prefix, return_bias=False)
