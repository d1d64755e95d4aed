"""V4.1's rotary embedding of each row's tail (interleaved GPT-J pairs) from vLLM's cos/sin
cache, in place: on the CPU the plugin's C kernel (kernels/cpu/rope.c, built by cpu_build)
for contiguous fp32 and bf16 rows, elsewhere its torch twin `rotate_pairs`, with the same
bits. In place because every caller rotates rows it just made; a copy of each row cost as
much as the rotation.

Traced into vLLM's compiled graph, the rotation's stride-2 pairs kept Inductor's code
scalar, and the concatenation of the rotated tail with the rest of the row copied every
value one at a time: about a tenth of a 1024-token prefill step and of a 32-request
decode step of the tiny model. The model calls it through one registered op
(model/deepseek_v41/rope.py), opaque to the graph."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from vllm_deepinfer.kernels import cpu_build
from vllm_deepinfer.kernels.cpu_build import ROW_DTYPES


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates each (even, odd) pair of x's last 2 * cos.shape[-1] dims by its angle, in
    at least fp32; cos and sin [T, ..., rope_dim // 2] broadcast against x [T, ..., D]."""
    rope_dim = 2 * cos.shape[-1]
    rot = x[..., -rope_dim:]
    rot = rot if rot.dtype == torch.float64 else rot.float()
    even, odd = rot[..., 0::2], rot[..., 1::2]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)


def rotate_torch(
    x: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor, inverse: bool
) -> torch.Tensor:
    """x [T, D] or [T, heads, D] rotated at its tokens' positions (the kernel's twin)."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return rotate_pairs(x, cos, -sin if inverse else sin)


@cache
def library() -> ctypes.CDLL | None:
    built = cpu_build.load("rope")
    if built is not None:
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        built.rope_tail.argtypes = [
            pointer, ctypes.c_int32, size, size, size, size, pointer, pointer, size, ctypes.c_int,
            ctypes.c_int,
        ]  # fmt: skip
        built.rope_tail.restype = ctypes.c_int
    return built


def fits(x: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
    """Whether the kernel rotates these rows: CPU, contiguous fp32 or bf16, a fp32 cache."""
    return (
        x.device.type == "cpu"
        and x.is_contiguous()
        and x.dtype in ROW_DTYPES
        and x.dim() in (2, 3)
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.shape[-1] <= x.shape[-1]
    )


def rotate_(
    x: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor, inverse: bool = False
) -> None:
    """Rotates x's row tails in place to `rotate_torch`'s values, through the C kernel
    where it `fits` and is built (else the twin's result is copied in)."""
    if positions.shape != x.shape[:1]:
        raise ValueError(f"rope: {positions.shape[0]} positions for {x.shape[0]} tokens")
    built = library() if fits(x, cos_sin_cache) else None
    if built is None:
        x.copy_(rotate_torch(x, cos_sin_cache, positions, inverse))
        return
    table = cos_sin_cache.contiguous()
    where = positions.to(torch.int64).contiguous()
    per_token = 1 if x.dim() == 2 else x.shape[1]
    failed = built.rope_tail(
        x.data_ptr(), ROW_DTYPES[x.dtype], x.numel() // x.shape[-1], x.shape[-1],
        table.shape[-1], per_token, where.data_ptr(), table.data_ptr(), table.shape[0],
        int(inverse), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        position = int(where[(failed - 1) // per_token])
        raise IndexError(f"rope: position {position} lies outside the {table.shape[0]} cached")
