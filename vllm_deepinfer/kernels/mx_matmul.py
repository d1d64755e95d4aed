"""Weight-only matmuls on the release's microscaled weights, as stored: MXFP8 linears
(e4m3 values, one UE8M0 scale per 32x32 block) and MXFP4 experts (two e2m1 nibbles a
byte, one UE8M0 scale per 32 values of a row).

Two paths, both keeping the weight in release precision:

- `mx_linear_tiled` dequantizes one tile of TILE_ROWS output rows at a time and
  multiplies it at once, so no more than one tile of the weight is ever held wide. It
  runs on any device torch runs on, and for products of many rows (prefill), where the
  matmul's cost hides the tile's.
- On the CPU, up to weight_gemv.MAX_ROWS activation rows (decode), the plugin's C
  kernel (kernels/weight_gemv.py), which dequantizes each 32-value block in registers
  and reads the stored bytes once: a decode step's expert and linear products are bound
  by memory, and the tiled path writes and rereads every tile wide.

Their torch twin dequantizes the whole weight first (checkpoint/mx_formats.py), then
multiplies; tests/kernels/ hold both paths to it. The model's quantization methods call
`mx_linear` through one registered op (model/deepseek_v41/quantization.py), so that a
compiled graph keeps it as one node."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from vllm_deepinfer.checkpoint.mx_formats import BLOCK, E2M1_VALUES, powers_of_two
from vllm_deepinfer.kernels import weight_gemv
from vllm_deepinfer.kernels.weight_gemv import MXFP4, MXFP8

TILE_ROWS = 256
"""Output rows dequantized at once (a multiple of the 32-row scale block)."""

_EXACT = (torch.float32, torch.bfloat16, torch.float64)
"""Dtypes with fp32's exponent range (subnormals included), where every UE8M0 scale is
exact."""

# Each packed byte's two e2m1 values (low nibble first), per dtype and device.
_PAIRS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _e2m1_pairs(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    if key not in _PAIRS:
        byte = torch.arange(256)
        pairs = torch.stack([E2M1_VALUES[byte & 0x0F], E2M1_VALUES[byte >> 4]], dim=-1)
        _PAIRS[key] = pairs.to(dtype=dtype, device=device)
    return _PAIRS[key]


def dequantized_rows(
    values: torch.Tensor,
    scale: torch.Tensor,
    start: int,
    stop: int,
    mxfp4: bool,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows [start, stop) of the stored weight in `dtype` (start a multiple of 32); the
    same values as the whole weight's dequantization (mx_formats.py): e2m1 and e4m3 values
    times powers of two are exact in bf16 and fp32 (fp16 is reached through fp32)."""
    if dtype not in _EXACT:
        return dequantized_rows(values, scale, start, stop, mxfp4).to(dtype)
    rows = stop - start
    if mxfp4:
        codes = values[start:stop].view(torch.uint8).to(torch.int32)
        pairs = F.embedding(codes, _e2m1_pairs(dtype, values.device))  # [rows, K/2, 2]
        k = pairs.shape[1] * 2
        blocks = pairs.view(rows, k // BLOCK, BLOCK)
        return (blocks * powers_of_two(scale[start:stop]).to(dtype)[:, :, None]).view(rows, k)
    k = values.shape[1]
    blocks = values[start:stop].to(dtype).view(rows // BLOCK, BLOCK, k // BLOCK, BLOCK)
    factors = powers_of_two(scale[start // BLOCK : stop // BLOCK]).to(dtype)
    return (blocks * factors[:, None, :, None]).view(rows, k)


def mx_linear_tiled(
    x: torch.Tensor,
    values: torch.Tensor,
    scale: torch.Tensor,
    mxfp4: bool,
    product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
) -> torch.Tensor:
    """x [..., K] @ W.T for the stored W [O, K], one TILE_ROWS-row tile dequantized at a
    time; `product` multiplies rows by a tile (batch-invariant mode passes its own). bf16
    tiles multiply in fp32 on a CPU without native bf16, where aten's bf16 product is
    several times slower than its fp32 one (the result is rounded to bf16 once, as a bf16
    product accumulating in fp32 rounds it)."""
    out_features = values.shape[0]
    rows = x.reshape(-1, x.shape[-1])
    out = rows.new_empty(rows.shape[0], out_features)
    compute = x.dtype
    if (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and product is F.linear
        and not weight_gemv.native_bf16()
    ):
        compute, rows = torch.float32, rows.float()
    for start in range(0, out_features, TILE_ROWS):
        stop = min(start + TILE_ROWS, out_features)
        tile = dequantized_rows(values, scale, start, stop, mxfp4, compute)
        out[:, start:stop] = product(rows, tile)
    return out.view(*x.shape[:-1], out_features)


def mx_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    scale: torch.Tensor,
    mxfp4: bool,
    product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """x @ W.T for the stored W: the C kernel for decode-sized products on the CPU, else
    tiled. A given `product` (batch-invariant mode's fixed-order matmul) runs tiled always,
    so that a row's result never depends on how many rows share the call."""
    if product is None and weight_gemv.fits(x):
        return weight_gemv.product(x, values, scale, MXFP4 if mxfp4 else MXFP8)
    return mx_linear_tiled(x, values, scale, mxfp4, product or F.linear)
