"""The plugin's C kernel for weight-bound products on the CPU (kernels/cpu/weight_gemv.c):
x [M, K] @ W.T for few activation rows (decode), W read once as stored (MXFP4, MXFP8 or
bf16) and widened in registers.

A decode step reads every weight it uses once per step for a handful of rows, so its
products are bound by memory: the tiled torch path (mx_matmul.py) writes each tile wide
and rereads it, and aten's bf16 product on a CPU without AVX512_BF16 converts the whole
weight per call. The kernel is compiled once per machine (cpu_build.py); where it
cannot be built, or DEEPINFER_MX_KERNEL=tiled, callers keep their torch path."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from vllm_deepinfer import envs
from vllm_deepinfer.checkpoint.mx_formats import BLOCK
from vllm_deepinfer.kernels import cpu_build

MXFP8, MXFP4, BF16, F32 = 0, 1, 2, 3
"""The stored formats the kernel reads (its `enum format`)."""
DENSE_FORMATS = {torch.bfloat16: BF16, torch.float32: F32}
MAX_ROWS = 32
"""The most activation rows the kernel takes; more run through the torch paths, whose
matmuls reuse each widened weight across rows (measured on a 2-core AVX2 machine: the
kernel is still ahead at 32 rows of a 4096 x 4096 MXFP4 weight, level at 64)."""


class ExpertStack(ctypes.Structure):
    """cpu/weight_gemv.c's `expert_stack`: a stack of experts' stored weights [E, O, ...]
    and scales, strides in bytes."""

    _fields_ = [
        ("values", ctypes.c_void_p),
        ("expert", ctypes.c_int64),
        ("row", ctypes.c_int64),
        ("scale", ctypes.c_void_p),
        ("scale_expert", ctypes.c_int64),
        ("scale_row", ctypes.c_int64),
    ]


def _stack(values: torch.Tensor, scale: torch.Tensor | None) -> ExpertStack:
    if values.device.type != "cpu" or values.stride(-1) != 1:
        raise ValueError("routed_experts: weights must be CPU tensors contiguous along K")
    if scale is not None and scale.stride(-1) != 1:
        raise ValueError("routed_experts: scales must be contiguous along K")
    size = values.element_size()
    return ExpertStack(
        values.data_ptr(),
        values.stride(0) * size,
        values.stride(1) * size,
        None if scale is None else scale.data_ptr(),
        0 if scale is None else scale.stride(0) * scale.element_size(),
        0 if scale is None else scale.stride(1) * scale.element_size(),
    )


@cache
def library(march: str = cpu_build.NATIVE) -> ctypes.CDLL | None:
    """The kernel built for this CPU (or for `march`), its signature declared; None where
    it cannot be built (cpu_build logs why)."""
    built = cpu_build.load("weight_gemv", march)
    if built is None:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    built.weight_gemv.argtypes = [
        pointer, size, size, pointer, size, pointer, size, size, ctypes.c_int, pointer,
        ctypes.c_int,
    ]  # fmt: skip
    built.weight_gemv.restype = ctypes.c_int
    stack = ctypes.POINTER(ExpertStack)
    built.routed_experts.argtypes = [
        pointer, size, size, size, pointer, pointer, size, ctypes.c_int, size, stack, stack,
        ctypes.c_float, pointer, pointer, ctypes.c_int,
    ]  # fmt: skip
    built.routed_experts.restype = ctypes.c_int
    built.weight_gemv_simd.restype = ctypes.c_int
    built.weight_gemv_init()
    return built


@cache
def enabled() -> bool:
    """DEEPINFER_MX_KERNEL, read once per process (parsing every setting per call cost
    0.3 ms, and a decode step makes dozens of calls)."""
    return envs.load().mx_kernel == "auto"


@cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512_BF16 or AMX); asked once.
    Elsewhere aten's and oneDNN's bf16 products widen the whole weight on every call."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def fits(x: torch.Tensor) -> bool:
    """Whether these activations take the kernel: on the CPU, 1 to MAX_ROWS rows, K a
    multiple of the 32-value block, the kernel built and not turned off."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    return (
        x.device.type == "cpu"
        and 0 < rows <= MAX_ROWS
        and k % BLOCK == 0
        and enabled()
        and library() is not None
    )


def product(
    x: torch.Tensor,
    values: torch.Tensor,
    scale: torch.Tensor | None,
    format: int,
    built: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """x [..., K] @ W.T, accumulated in fp32, returned in x's dtype. `values` [O, ...] and
    `scale` are the stored tensors (rows may be strided, as an expert's slice of a stack;
    each row contiguous); `built` picks a library other than this CPU's (tests)."""
    built = built or library()
    if built is None:
        raise RuntimeError("the weight_gemv kernel is not built on this machine")
    if values.device.type != "cpu" or values.stride(-1) != 1:
        raise ValueError("weight_gemv: values must be CPU tensors contiguous along K")
    k, out_features = x.shape[-1], values.shape[0]
    if scale is not None and scale.stride(-1) != 1:
        raise ValueError("weight_gemv: scales must be contiguous along K")
    rows = x.reshape(-1, k).to(torch.float32).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    failed = built.weight_gemv(
        rows.data_ptr(), rows.shape[0], k,
        values.data_ptr(), values.stride(0) * values.element_size(),
        None if scale is None else scale.data_ptr(),
        0 if scale is None else scale.stride(0) * scale.element_size(),
        out_features, format, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError(f"weight_gemv: no memory for a row buffer of {k} floats")
    return out.to(x.dtype).view(*x.shape[:-1], out_features)


def routed_experts(
    x: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    format: int,
    w13: tuple[torch.Tensor, torch.Tensor | None],
    w2: tuple[torch.Tensor, torch.Tensor | None],
    limit: float,
    built: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """V4.1's routed experts of few tokens in one call: x [T, H], chosen and weights
    [T, k]; w13 = (values [E, 2I, ...], scales or None), w2 = (values [E, H, ...], scales
    or None) as stored. fp32 inside, returned in x's dtype."""
    built = built or library()
    if built is None:
        raise RuntimeError("the weight_gemv kernel is not built on this machine")
    t, h = x.shape
    k, inter = chosen.shape[1], w13[0].shape[1] // 2
    rows = x.to(torch.float32).contiguous()
    picks = chosen.to(torch.int64).contiguous()
    experts = w13[0].shape[0]
    weighs = weights.to(torch.float32).contiguous()
    scratch = torch.empty(t * k * (3 * inter + 2 * h), dtype=torch.float32)
    out = torch.empty(t, h, dtype=torch.float32)
    failed = built.routed_experts(
        rows.data_ptr(), t, h, k, picks.data_ptr(), weighs.data_ptr(), inter, format, experts,
        ctypes.byref(_stack(*w13)), ctypes.byref(_stack(*w2)), limit, scratch.data_ptr(),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed == -2:
        raise IndexError(f"routed_experts: an expert index lies outside the {experts} held")
    if failed:
        raise MemoryError("routed_experts: no memory for its row buffers")
    return out.to(x.dtype)
