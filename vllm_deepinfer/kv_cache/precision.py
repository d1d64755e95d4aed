"""The quantized records DeepSeek V4.1's release stores its global KV in, in plain torch.

Compressed latents (512 dims) and lightning-indexer keys (128 dims) can be kept in the
block-scaled records that upstream vLLM's DeepSeek V4.1 kernels write
(vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py, indexer_k_store.py).
The encoders here produce the same bytes for finite inputs, on the CPU or any device:

| format          | values                           | scales                      | bytes |
|-----------------|----------------------------------|-----------------------------|-------|
| NVFP4 latent    | 256 B of e2m1 pairs              | 32 e4m3, one per 16 dims    | 288   |
| MXFP8 latent    | 512 e4m3                         | 16 UE8M0, one per 32 dims   | 528   |
| V4 latent       | 448 e4m3 + 64 bf16 (RoPE) dims   | 7 UE8M0 per 64 dims + 1 pad | 584   |
| MXFP4 index key | 64 B of e2m1 pairs               | 4 UE8M0, one per 32 dims    | 68    |
| FP8 index key   | 128 e4m3                         | one fp32 power of two       | 132   |

e2m1 pairs hold dim 2k in the low nibble, 2k+1 in the high one; UE8M0 byte b means
2**(b - 127). Upstream's paged blocks keep a block's value bytes apart from its scale
bytes ([B x values][B x scales]); our paged caches hold one row per token, so here a
token's record is one contiguous row of `record_bytes` uint8: values, then scales.

As upstream: scales come from amax times the fp32 reciprocal of the format's maximum;
values are scaled in fp32 and rounded to nearest, ties to even. The input is the vector
as stored (upstream's RoPE and bf16 rounding happen before, in its producers). Decoding to
bf16 gives what upstream's dequantize-and-gather kernels give for the latents. NVFP4 has
no per-tensor scale, so blocks beyond amax 6 * 448 saturate, and below amax 6 * 2**-6 the
e4m3 scale is subnormal and coarse (upstream clamps it at 2**-9, not at the normal 2**-6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_deepinfer.checkpoint.mx_formats import E2M1_VALUES

_MAX = {"e4m3": 448.0, "e2m1": 6.0}
# Upstream floors a block's amax before picking its power-of-two scale.
_AMAX_FLOOR = {"e4m3": 1e-4, "e2m1": 6 * 2.0**-126}
_SCALE_DTYPES = {"fp32": torch.float32, "e4m3": torch.float8_e4m3fn}
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# Midpoints whose upper neighbour has the even code: ties there round up.
_E2M1_TIES_UP = (0.75, 1.75, 3.5)


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) for positive x, exact: frexp instead of a log2 whose rounding (torch's
    or the GPU's) could decide it within an ulp of a power of two."""
    mantissa, exponent = torch.frexp(x)
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).to(torch.float32)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nibbles of the nearest e2m1 values (ties to the even code, beyond 6 saturating to 6,
    the sign kept in bit 3), as cvt.rn.satfinite.e2m1x2.f32 rounds."""
    mag = x.abs()
    codes = torch.bucketize(mag, torch.tensor(_E2M1_MIDPOINTS, device=x.device))
    codes += torch.isin(mag, torch.tensor(_E2M1_TIES_UP, device=x.device))
    return codes.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


@dataclass(frozen=True)
class RecordFormat:
    """One per-token record: `width` floats in, `record_bytes` uint8 out.

    The first `width - rope_dims` dims are quantized in blocks of `block` to `values`
    ("e4m3" or "e2m1") with one scale per block, stored as `scale`: "ue8m0" (one byte),
    "fp32" (a power of two, 4 bytes) or "e4m3" (NVFP4's amax / 6, one byte). The last
    `rope_dims` dims are stored as bf16. Bytes left over at the end are zero padding.
    """

    name: str  # the vLLM setting that selects it (--kv-cache-dtype or indexer_kv_dtype)
    width: int
    record_bytes: int
    values: str
    block: int
    scale: str
    rope_dims: int = 0

    def __post_init__(self):
        if self._padding < 0:
            raise ValueError(f"{self.name}: the layout needs more than {self.record_bytes} B")

    @property
    def _quantized_dims(self) -> int:
        return self.width - self.rope_dims

    @property
    def _value_bytes(self) -> int:
        return self._quantized_dims // 2 if self.values == "e2m1" else self._quantized_dims

    @property
    def _scale_bytes(self) -> int:
        return self._quantized_dims // self.block * (4 if self.scale == "fp32" else 1)

    @property
    def _padding(self) -> int:
        return self.record_bytes - self._value_bytes - 2 * self.rope_dims - self._scale_bytes

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[..., width] float -> [..., record_bytes] uint8, rounding as upstream does."""
        if x.shape[-1] != self.width:
            raise ValueError(f"{self.name} encodes {self.width} dims, got {tuple(x.shape)}")
        lead, x = x.shape[:-1], x.float()
        blocks = x[..., : self._quantized_dims].unflatten(-1, (-1, self.block))
        amax = blocks.abs().amax(-1, keepdim=True)
        if self.scale == "e4m3":
            # amax / 6 rounded to e4m3 (clamped to its range), divided out exactly.
            scale = (amax * (1 / 6)).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn)
            scaled, scale_bytes = blocks / scale.float(), scale.view(torch.uint8)
        else:
            # The smallest power of two that brings amax within the values' range.
            limit = _MAX[self.values]
            exponent = _ceil_log2(amax.clamp_min(_AMAX_FLOOR[self.values]) * (1 / limit))
            exponent = exponent.clamp(-127, 127)
            scaled = blocks * torch.exp2(-exponent)
            scale_bytes = (
                (exponent + 127).to(torch.uint8)
                if self.scale == "ue8m0"
                else torch.exp2(exponent).view(torch.uint8)
            )
        if self.values == "e4m3":
            values = scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            codes = _e2m1_codes(scaled).flatten(-2)
            values = codes[..., 0::2] | (codes[..., 1::2] << 4)
        rope = x[..., self._quantized_dims :].to(torch.bfloat16).contiguous()
        padding = torch.zeros(*lead, self._padding, dtype=torch.uint8, device=x.device)
        return torch.cat(
            [
                values.reshape(*lead, -1),
                rope.view(torch.uint8),
                scale_bytes.reshape(*lead, -1),
                padding,
            ],
            -1,
        )

    def decode(self, records: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[..., record_bytes] uint8 -> [..., width] in `dtype` (products taken in fp32)."""
        if records.dtype != torch.uint8 or records.shape[-1] != self.record_bytes:
            raise ValueError(
                f"{self.name} decodes uint8 [..., {self.record_bytes}], got "
                f"{records.dtype} {tuple(records.shape)}"
            )
        rope_end = self._value_bytes + 2 * self.rope_dims
        raw = records[..., : self._value_bytes]
        scales = records[..., rope_end : rope_end + self._scale_bytes]
        if self.values == "e4m3":
            values = raw.view(torch.float8_e4m3fn).float()
        else:
            codes = torch.stack([raw & 0x0F, raw >> 4], -1).flatten(-2)
            values = E2M1_VALUES.to(records.device)[codes.long()]
        if self.scale == "ue8m0":
            scale = torch.exp2(scales.float() - 127)
        else:
            scale = scales.contiguous().view(_SCALE_DTYPES[self.scale]).float()
        out = (values.unflatten(-1, (-1, self.block)) * scale.unsqueeze(-1)).flatten(-2)
        rope = records[..., self._value_bytes : rope_end].contiguous().view(torch.bfloat16)
        return torch.cat([out, rope.float()], -1).to(dtype)


NVFP4_LATENT = RecordFormat("nvfp4_ds_mla", 512, 288, values="e2m1", block=16, scale="e4m3")
MXFP8_LATENT = RecordFormat("fp8_ds_mla", 512, 528, values="e4m3", block=32, scale="ue8m0")
# V4's record; upstream V4.1 writes it under the same name where FlashMLA lacks the above.
V4_FP8_LATENT = RecordFormat(
    "fp8_ds_mla", 512, 584, values="e4m3", block=64, scale="ue8m0", rope_dims=64
)
MXFP4_INDEX_KEY = RecordFormat("mxfp4", 128, 68, values="e2m1", block=32, scale="ue8m0")
FP8_INDEX_KEY = RecordFormat("fp8", 128, 132, values="e4m3", block=128, scale="fp32")

_MODEL_DTYPES = ("auto", "bfloat16", "float32", "float16")
_INDEX_KEY_MODEL_DTYPES = (None, "auto", "bfloat16", "bf16")
# "fp8_ds_mla" is the MXFP8 record: upstream V4.1 writes it wherever FlashMLA can read it
# back (SM100; attention.py `_use_v41_mxfp8_kv_record`) and only falls back to V4's 584 B
# record on GPUs whose FlashMLA cannot. Our caches are read by our own code on any device,
# so nothing forces the fallback; nvfp4_ds_mla also exists only beside the MXFP8 record.
_LATENT_FORMATS = {f.name: f for f in (NVFP4_LATENT, MXFP8_LATENT)}
_INDEX_KEY_FORMATS = {f.name: f for f in (FP8_INDEX_KEY, MXFP4_INDEX_KEY)}


def latent_format(kv_cache_dtype: str) -> RecordFormat | None:
    """The compressed-latent record for a --kv-cache-dtype; None keeps the model dtype."""
    return _chosen(
        "kv_cache_dtype", kv_cache_dtype, _MODEL_DTYPES, _LATENT_FORMATS, " for DeepSeek V4.1"
    )


def index_key_format(indexer_kv_dtype: str | None) -> RecordFormat | None:
    """The index-key record for an indexer_kv_dtype; None (and "auto") keeps the model dtype
    (upstream's "auto" means fp8 for this indexer; here quantizing is opted into)."""
    return _chosen(
        "indexer_kv_dtype", indexer_kv_dtype, _INDEX_KEY_MODEL_DTYPES, _INDEX_KEY_FORMATS
    )


def _chosen(
    setting: str, value, model_dtypes: tuple, formats: dict, where: str = ""
) -> RecordFormat | None:
    if value in model_dtypes:
        return None
    if value not in formats:
        raise ValueError(
            f"{setting} {value!r} is not supported{where}; expected one of "
            f"{[*model_dtypes, *formats]}"
        )
    return formats[value]


def persisted_bytes_per_token(
    args, latent: RecordFormat | None, index_key: RecordFormat | None, model_dtype_bytes: int
) -> float:
    """Global KV bytes a token costs: each kv source keeps one latent and one index key per
    `ratio` tokens. A None format means the vector in the model dtype."""
    latent_bytes = args.head_dim * model_dtype_bytes if latent is None else latent.record_bytes
    key_bytes = (
        args.index_head_dim * model_dtype_bytes if index_key is None else index_key.record_bytes
    )
    return sum((latent_bytes + key_bytes) / args.ratio(layer) for layer in args.kv_source_layer_ids)
