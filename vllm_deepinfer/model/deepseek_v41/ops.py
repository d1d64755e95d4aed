"""Numerics every V4.1 part shares. Each concern's own math lives beside its module
(attention.py, compressor.py, indexer.py, moe.py, engram.py, hyper_connections.py); the
paged vLLM model and the dense reference forward both call it."""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)


def wide(x: torch.Tensor) -> torch.Tensor:
    """At least fp32: the reference may run everything in fp64."""
    return x if x.dtype == torch.float64 else x.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = wide(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * wide(weight)
    return y.to(x.dtype)


SORTED_TOPK_WIDTH = 1024
"""Rows at most this wide (the router's experts) take their top-k from one stable sort:
no data-dependent shapes, so it traces into the compiled graph."""


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest per row [T, G], largest first, ties to the lower index
    (ReLU scores tie exactly and often; one tie rule keeps paged and dense selections in
    agreement): what a stable descending sort gives. Narrow rows are sorted; wide ones
    (the indexer's long contexts, where a sort was most of its time) are found without
    sorting G: everything above each row's k-th value, then its ties in index order; only
    the k are sorted."""
    scores = scores.nan_to_num(nan=float("-inf"))  # a NaN row still gives k indices
    if scores.shape[-1] <= SORTED_TOPK_WIDTH:
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    kth = torch.topk(scores, k, dim=-1).values[:, -1:]
    above, tied = scores > kth, scores == kth
    chosen = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
    positions = chosen.nonzero()[:, 1].view(scores.shape[0], k)
    order = torch.sort(scores.gather(1, positions), dim=-1, descending=True, stable=True)
    return positions.gather(1, order.indices)


def _quant_config(quantized: bool):
    """The engine's quantization config for a projection the release quantizes (MXFP8:
    `quantized`), none for one it stores in bf16."""
    return get_current_vllm_config().quant_config if quantized else None


def linear(
    in_features: int,
    out_features: int,
    prefix: str,
    dtype: torch.dtype | None = None,
    quantized: bool = False,
) -> ReplicatedLinear:
    """V4.1's projections: no bias, whole on every rank."""
    return ReplicatedLinear(
        in_features,
        out_features,
        bias=False,
        params_dtype=dtype,
        quant_config=_quant_config(quantized),
        prefix=prefix,
        return_bias=False,
    )


def column_linear(
    in_features: int, out_features: int, prefix: str, quantized: bool = False
) -> ColumnParallelLinear:
    """A projection whose outputs split across tensor-parallel ranks (kept split)."""
    return ColumnParallelLinear(
        in_features,
        out_features,
        bias=False,
        gather_output=False,
        quant_config=_quant_config(quantized),
        prefix=prefix,
        return_bias=False,
    )


def row_linear(
    in_features: int,
    out_features: int,
    prefix: str,
    reduce_results: bool = True,
    quantized: bool = False,
) -> RowParallelLinear:
    """A projection whose inputs arrive split across tensor-parallel ranks; its partial
    sums are all-reduced unless `reduce_results` is False (the caller reduces once)."""
    return RowParallelLinear(
        in_features,
        out_features,
        bias=False,
        input_is_parallel=True,
        reduce_results=reduce_results,
        quant_config=_quant_config(quantized),
        prefix=prefix,
        return_bias=False,
    )
