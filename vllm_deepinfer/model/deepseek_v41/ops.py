"""Numerics every V4.1 part shares. Each concern's own math lives beside its module
(attention.py, compressor.py, indexer.py, moe.py, engram.py, hyper_connections.py); the
paged vLLM model and the dense reference forward both call it."""
from __future__ import annotations

from typing import Callable

import torch
from vllm.model_executor.layers.linear import ReplicatedLinear

from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)


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


def compiled(fn: Callable) -> Callable:
    """`fn` under torch.compile (one graph, any number of tokens), for chains of small ops
    whose per-op dispatch costs more than their arithmetic. If compiling fails (inductor
    on the CPU needs a C++ compiler), `fn` itself runs from then on, with one warning."""
    runs = {"fn": torch.compile(fn, dynamic=True, fullgraph=True)}

    def call(*args):
        try:
            return runs["fn"](*args)
        except Exception as exc:  # noqa: BLE001 - any compile failure falls back to eager
            if runs["fn"] is fn:
                raise
            logger.warning("torch.compile of %s failed (%s: %s); running it eagerly",
                           fn.__qualname__, type(exc).__name__, exc)
            runs["fn"] = fn
            return fn(*args)

    return call
