"""The release checkpoint's microscaling formats, quantized (checkpoint writer) and
dequantized (loader, on any device).

MXFP8 linears: float8_e4m3fn values, one UE8M0 scale per 32x32 block, `[O/32, K/32]`.
MXFP4 experts: e2m1 nibbles packed two per int8 byte along K (element 2j in the low
nibble), one UE8M0 scale per 32 values of a row, `[O, K/32]`.
Engram tables: float8_e4m3fn rows, one UE8M0 scale per 32 values of a row.
UE8M0 byte b means 2**(b - 127), stored as float8_e8m0fnu (uint8 bytes are accepted).
"""

from __future__ import annotations

import torch

BLOCK = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)


def _scale_bytes(amax: torch.Tensor, format_max: float) -> torch.Tensor:
    """Smallest power-of-two scale that fits amax into the format, as UE8M0 bytes."""
    exponent = torch.ceil(torch.log2(amax.clamp_min(2.0**-126) / format_max))
    return (exponent + 127).clamp(1, 254).to(torch.uint8)


def check_scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """The UE8M0 scales as uint8 bytes; refuses another dtype and the NaN byte 255."""
    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(f"UE8M0 scales must be float8_e8m0fnu or uint8, got {scale.dtype}")
    raw = scale.view(torch.uint8)
    if bool((raw == 255).any()):
        raise ValueError("UE8M0 scale byte 255 is NaN")
    return raw


def powers_of_two(scale_bytes: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (checked) as the float32 powers of two 2**(b - 127)."""
    return torch.exp2(scale_bytes.view(torch.uint8).to(torch.float32) - 127)


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    return powers_of_two(check_scale_bytes(scale))


def _as_e8m0(scale_bytes: torch.Tensor) -> torch.Tensor:
    return scale_bytes.view(torch.float8_e8m0fnu)


def _check_divisible(shape: torch.Size, dims: tuple[int, ...], what: str) -> None:
    for d in dims:
        if shape[d] % BLOCK:
            raise ValueError(
                f"{what}: dim {d} of shape {tuple(shape)} is not a multiple of {BLOCK}"
            )


def quantize_mxfp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[O, K] -> (e4m3 [O, K], UE8M0 [O/32, K/32])."""
    _check_divisible(weight.shape, (0, 1), "MXFP8")
    o, k = weight.shape
    blocks = weight.float().reshape(o // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = _scale_bytes(blocks.abs().amax(dim=(1, 3)), E4M3_MAX)
    values = blocks / _scale_values(scale)[:, None, :, None]
    return values.reshape(o, k).to(torch.float8_e4m3fn), _as_e8m0(scale)


def dequantize_mxfp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    o, k = values.shape
    if tuple(scale.shape) != (o // BLOCK, k // BLOCK):
        raise ValueError(
            f"MXFP8 scale shape {tuple(scale.shape)} does not match weight "
            f"{(o, k)}; expected {(o // BLOCK, k // BLOCK)}"
        )
    blocks = values.float().reshape(o // BLOCK, BLOCK, k // BLOCK, BLOCK)
    return (blocks * _scale_values(scale)[:, None, :, None]).reshape(o, k)


def quantize_rowwise_fp8(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Engram table [R, D] -> (e4m3 [R, D], UE8M0 [R, D/32])."""
    _check_divisible(table.shape, (1,), "row-wise FP8")
    r, d = table.shape
    groups = table.float().reshape(r, d // BLOCK, BLOCK)
    scale = _scale_bytes(groups.abs().amax(dim=2), E4M3_MAX)
    values = groups / _scale_values(scale)[:, :, None]
    return values.reshape(r, d).to(torch.float8_e4m3fn), _as_e8m0(scale)


def dequantize_rowwise_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    r, d = values.shape
    if tuple(scale.shape) != (r, d // BLOCK):
        raise ValueError(
            f"row-wise FP8 scale shape {tuple(scale.shape)} does not match "
            f"table {(r, d)}; expected {(r, d // BLOCK)}"
        )
    groups = values.float().reshape(r, d // BLOCK, BLOCK)
    return (groups * _scale_values(scale)[:, :, None]).reshape(r, d)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[O, K] -> (packed int8 [O, K/2], UE8M0 [O, K/32]); rounds to the nearest e2m1 value,
    ties to even."""
    _check_divisible(weight.shape, (1,), "MXFP4")
    o, k = weight.shape
    groups = weight.float().reshape(o, k // BLOCK, BLOCK)
    scale = _scale_bytes(groups.abs().amax(dim=2), E2M1_MAX)
    scaled = (groups / _scale_values(scale)[:, :, None]).reshape(o, k)
    distance = (scaled[..., None] - E2M1_VALUES).abs()
    nearest = distance == distance.min(dim=-1, keepdim=True).values
    # Ties go to the even code (round half to even, as OCP MX and upstream round).
    odd = (torch.arange(16) % 2).to(distance.dtype)
    codes = torch.where(nearest, odd, float("inf")).argmin(dim=-1).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), _as_e8m0(scale)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    o, half_k = packed.shape
    k = 2 * half_k
    if tuple(scale.shape) != (o, k // BLOCK):
        raise ValueError(
            f"MXFP4 scale shape {tuple(scale.shape)} does not match packed weight "
            f"{(o, half_k)}; expected {(o, k // BLOCK)}"
        )
    raw = packed.view(torch.uint8)
    codes = torch.stack([raw & 0x0F, raw >> 4], dim=-1).reshape(o, k)
    values = E2M1_VALUES[codes.long()].reshape(o, k // BLOCK, BLOCK)
    return (values * _scale_values(scale)[:, :, None]).reshape(o, k)
