"""Sinkhorn normalisation of the hyper-connections' copy-to-copy mix (V4.1's mHC): on the
CPU the plugin's C kernel (kernels/cpu/sinkhorn.c, built by cpu_build), elsewhere and for
other dtypes its torch twin, `sinkhorn_torch`.

The loop is short work on [T, hc, hc] matrices but 20 steps long: traced into vLLM's
compiled graph, Inductor unrolls it into one generated kernel that takes most of the
model's compile time; eager, it is 80 small aten calls per sublayer boundary. The model
calls it through one registered op (model/deepseek_v41/hyper_connections.py), opaque to
the graph."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from vllm_deepinfer.kernels import cpu_build


def sinkhorn_torch(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Columns normalised, then `iters - 1` times rows and columns: x / (sum + eps)."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


@cache
def library() -> ctypes.CDLL | None:
    built = cpu_build.load("sinkhorn")
    if built is not None:
        built.sinkhorn.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_float,
            ctypes.c_int,
        ]  # fmt: skip
        built.sinkhorn.restype = None
    return built


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`sinkhorn_torch`'s result, through the C kernel for fp32 CPU tensors."""
    built = library() if comb.device.type == "cpu" and comb.dtype == torch.float32 else None
    if built is None:
        return sinkhorn_torch(comb, iters, eps)
    out = comb.contiguous().clone()
    n = out.shape[-1]
    built.sinkhorn(out.data_ptr(), out.numel() // (n * n), n, iters, eps, torch.get_num_threads())
    return out
