"""The release checkpoint's storage formats, one table that the layout (which file
tensors a logical tensor becomes), the writer (encode) and the loader (decode) all read.

| format   | values                          | `.scale` sibling (UE8M0)    | used for                  |
|----------|---------------------------------|-----------------------------|---------------------------|
| bf16     | bfloat16 [O, K]                 | none                        | norms, router, compressor |
| f32      | float32                         | none                        | hc parameters, sinks      |
| mxfp8    | float8_e4m3fn [O, K]            | [O/32, K/32], 32x32 blocks  | quantized linears         |
| mxfp4    | int8 [O, K/2], two e2m1 a byte  | [O, K/32], 32 per row       | routed experts            |
| fp8_rows | float8_e4m3fn [R, D]            | [R, D/32], 32 per row       | Engram tables             |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_deepinfer.checkpoint import mx_formats
from vllm_deepinfer.checkpoint.mx_formats import BLOCK

BF16, F32, MXFP8, MXFP4, FP8_ROWS = "bf16", "f32", "mxfp8", "mxfp4", "fp8_rows"


@dataclass(frozen=True)
class StorageFormat:
    name: str
    values_dtype: torch.dtype
    values_shape: Callable[[int, int], tuple[int, ...]] | None = None  # None: as logical
    scale_shape: Callable[[int, int], tuple[int, int]] | None = None  # None: no .scale
    encode: Callable | None = None  # logical -> (values, scale)
    decode: Callable | None = None  # (values, scale) -> logical float32

    @property
    def scaled(self) -> bool:
        return self.scale_shape is not None

    def stored(
        self, name: str, shape: tuple[int, ...]
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The file tensors (name -> (shape, dtype)) that hold one logical tensor."""
        if not self.scaled:
            return {name: (shape, self.values_dtype)}
        assert self.scale_shape is not None  # scaled
        o, k = shape
        values = self.values_shape(o, k) if self.values_shape else shape
        return {
            name: (values, self.values_dtype),
            scale_name(name): (self.scale_shape(o, k), torch.float8_e8m0fnu),
        }

    def write(self, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """The file tensors for one logical tensor (the checkpoint writer's side)."""
        if not self.scaled:
            return {name: value.to(self.values_dtype).contiguous()}
        assert self.encode is not None, f"{self.name} is scaled, so it has an encoder"
        values, scale = self.encode(value)
        return {name: values.contiguous(), scale_name(name): scale.contiguous()}


def scale_name(weight_name: str) -> str:
    base = weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name
    return f"{base}.scale"


FORMATS: dict[str, StorageFormat] = {
    f.name: f
    for f in (
        StorageFormat(BF16, torch.bfloat16),
        StorageFormat(F32, torch.float32),
        StorageFormat(
            MXFP8,
            torch.float8_e4m3fn,
            scale_shape=lambda o, k: (o // BLOCK, k // BLOCK),
            encode=mx_formats.quantize_mxfp8,
            decode=mx_formats.dequantize_mxfp8,
        ),
        StorageFormat(
            MXFP4,
            torch.int8,
            values_shape=lambda o, k: (o, k // 2),
            scale_shape=lambda o, k: (o, k // BLOCK),
            encode=mx_formats.quantize_mxfp4,
            decode=mx_formats.dequantize_mxfp4,
        ),
        StorageFormat(
            FP8_ROWS,
            torch.float8_e4m3fn,
            scale_shape=lambda o, k: (o, k // BLOCK),
            encode=mx_formats.quantize_rowwise_fp8,
            decode=mx_formats.dequantize_rowwise_fp8,
        ),
    )
}
