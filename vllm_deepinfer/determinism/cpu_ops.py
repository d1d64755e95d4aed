"""Batch-invariant CPU kernels for the aten ops vLLM's VLLM_BATCH_INVARIANT replaces.

Upstream registers Triton kernels for mm/addmm/bmm/softmax/log_softmax/mean at the
platform's dispatch key; on the CPU that key is "CPU", Triton has no CPU backend, and the
first sample crashes the engine. These torch implementations take their place there
(patches/batch_invariant_cpu.py): matrix multiplies on fixed row tiles (batch_invariant.py),
and `mean` kept off the split-reduction path the CPU takes for a single output. CPU
softmax and log_softmax reduce each row on one thread already and stay as they are."""

from __future__ import annotations

import math

import torch

from vllm_deepinfer.determinism import batch_invariant

_library: torch.library.Library | None = None


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return batch_invariant.row_tiled(lambda tile: batch_invariant.matmul(tile, b), a)


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1):
    product = mm(a, b)
    if alpha != 1:
        product = product * alpha
    return product + (bias if beta == 1 else bias * beta)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Entries of any row count: each entry's rows in ROW_TILE tiles, every tile one
    [ROW_TILE, K] entry of `batch_invariant.bmm`."""
    entries, rows, inner = a.shape
    tiles = -(-rows // batch_invariant.ROW_TILE)
    padded = a.new_zeros(entries, tiles * batch_invariant.ROW_TILE, inner)
    padded[:, :rows] = a
    out = batch_invariant.bmm(
        padded.view(entries * tiles, batch_invariant.ROW_TILE, inner),
        b[:, None].expand(-1, tiles, -1, -1).reshape(entries * tiles, *b.shape[1:]),
    )
    return out.view(entries, -1, b.shape[2])[:, :rows]


def mean_dim(x: torch.Tensor, dim, keepdim: bool = False, dtype=None) -> torch.Tensor:
    """A sum over `dim` divided by its count. With a single output the CPU splits the sum
    across threads (another order than one row of many); two identical rows keep it on
    the per-row path."""
    dims = [d % x.dim() for d in (dim if dim else range(x.dim()))]
    count = math.prod(x.shape[d] for d in dims)
    if count == x.numel() and x.numel() > 1:
        pair = x.unsqueeze(0).expand(2, *x.shape)
        total = torch.sum(pair, [d + 1 for d in dims], keepdim=keepdim, dtype=dtype)[0]
    else:
        total = torch.sum(x, dims, keepdim=keepdim, dtype=dtype)
    return total / count


def register() -> None:
    """Installs the kernels at the CPU dispatch key (once per process)."""
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("aten", "IMPL")
    for op, kernel in (
        ("aten::mm", mm),
        ("aten::addmm", addmm),
        ("aten::bmm", bmm),
        ("aten::mean.dim", mean_dim),
    ):
        _library.impl(op, kernel, "CPU")
