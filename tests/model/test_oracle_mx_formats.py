"""The release checkpoint's microscaling formats against known values and upstream vLLM.

Known values are hand-computed bytes (the derivation is next to each literal):
UE8M0 byte b = 2**(b - 127) (OCP MX spec; byte 0 = 2**-127); e4m3fn = 1 sign, 4 exponent
(bias 7), 3 mantissa bits, subnormals 2**-6 * m/8, max 448 = 0x7E, round half to even;
e2m1 nibbles index [0, .5, 1, 1.5, 2, 3, 4, 6] with bit 3 the sign, the even element of a
pair in the low nibble.

Upstream vLLM's torch-native helpers, imported:
* `_dequant_linear_weight` (vllm/models/deepseek_v4/cpu/cpu_sparse.py:108-141) -- block-
  scaled FP8 linear weights, here with V4.1's [32, 32] blocks and UE8M0 scales;
* `_upcast_e8m0_to_fp32` (vllm/model_executor/layers/quantization/utils/fp8_utils.py:1157);
* `dequant_mxfp8_to_bf16` and `_mxfp8_e4m3_quantize_torch` (.../utils/mxfp8_utils.py:230,
  :38) -- one UE8M0 scale per 32 values of a row (the Engram tables' format);
* `_dequant_mxfp4_ue8m0_gran32` (vllm/model_executor/layers/fused_moe/
  flashinfer_moe_ep.py:184) -- MXFP4 experts; `break_fp4_bytes` and `cast_to_fp4`
  (.../utils/nvfp4_emulation_utils.py:529, :626) -- e2m1 decoding and rounding.
"""

from types import SimpleNamespace

import pytest
import torch

from helpers import upstream
from vllm_deepinfer.checkpoint.mx_formats import (
    dequantize_mxfp4,
    dequantize_mxfp8,
    dequantize_rowwise_fp8,
    quantize_mxfp4,
    quantize_mxfp8,
    quantize_rowwise_fp8,
)

pytestmark = pytest.mark.unit


FP8_UTILS = "vllm.model_executor.layers.quantization.utils.fp8_utils"
MXFP8_UTILS = "vllm.model_executor.layers.quantization.utils.mxfp8_utils"
NVFP4_UTILS = "vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def e8m0(byte_values) -> torch.Tensor:
    return torch.tensor(byte_values, dtype=torch.uint8).view(torch.float8_e8m0fnu)


# --- UE8M0 -----------------------------------------------------------------------------
UE8M0_KNOWN = {
    0: 2.0**-127,  # 5.877e-39, an fp32 subnormal (OCP: 0x00 is 2^-127, not zero)
    1: 2.0**-126,  # 1.1755e-38, smallest fp32 normal
    64: 2.0**-63,
    126: 0.5,
    127: 1.0,
    128: 2.0,
    200: 2.0**73,
    254: 2.0**127,  # 1.7014e38, the largest scale
}


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.uint8])
def test_ue8m0_bytes_decode_to_powers_of_two(scale_dtype):
    """A row of e4m3 ones (0x38) times each scale byte gives 2**(b - 127) exactly, whether
    the scales come as float8_e8m0fnu or raw uint8; upstream's own upcast agrees for every
    byte but 0, which it maps to 0.0 (its fp32 bit trick has no subnormals) -- harmless for
    the checkpoint, whose quantizers never write 0 (ours: >= 1; upstream's: only for an
    all-zero block, whose values are 0 anyway)."""
    upcast = upstream(FP8_UTILS, "_upcast_e8m0_to_fp32")
    scale_bytes = list(UE8M0_KNOWN)
    ones = torch.full((len(scale_bytes), 32), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.tensor(scale_bytes, dtype=torch.uint8)[:, None]
    if scale_dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.float8_e8m0fnu)

    decoded = dequantize_rowwise_fp8(ones, scale)

    expected = torch.tensor(list(UE8M0_KNOWN.values()), dtype=torch.float32)
    assert torch.equal(decoded, expected[:, None].expand(-1, 32))
    upstream_values = upcast(torch.tensor(scale_bytes, dtype=torch.uint8))
    assert torch.equal(upstream_values[1:], expected[1:]) and upstream_values[0] == 0


# --- MXFP8 linears: [O, K] e4m3 with one UE8M0 scale per 32x32 block --------------------
def known_mxfp8_weight():
    """A 32 x 96 weight, three 32x32 blocks side by side, with the bytes expected for each
    chosen element (every other element is 0 -> 0x00)."""
    w = torch.zeros(32, 96)
    values, expected = {}, {}

    def put(pos, value, byte):
        values[pos], expected[pos] = value, byte

    # Block 0: amax 3.0 -> exponent ceil(log2(3 / 448)) = ceil(-7.22) = -7 -> byte 120;
    # elements are stored as x * 2**7.
    put((0, 0), 3.0, 0x7C)  # 384 = 1.5 * 2**8: exp 8+7=15 (1111), mant .5 (100)
    put((0, 1), -3.0, 0xFC)  # the same with the sign bit
    put((1, 0), 2.0**-7, 0x38)  # 1.0: exp 0+7 = 0111, mant 000
    put((2, 5), -0.5, 0xE8)  # -64 = -1.0 * 2**6: 1 1101 000
    put((3, 7), 2.0**-16, 0x01)  # 2**-9, the smallest subnormal: 0 0000 001
    put((4, 9), 1.0625 / 128, 0x38)  # 1.0625: tie of 1.0 (m=000) / 1.125 (001) -> even 000
    put((5, 11), 1.1875 / 128, 0x3A)  # 1.1875: tie of 1.125 (001) / 1.25 (010) -> even 010
    put((31, 31), 0.1, 0x55)  # 12.8 = 1.6 * 2**3 -> 13 = 1.625 * 8: 0 1010 101
    # Block 1: amax 448 -> exponent 0 -> byte 127; elements stored as they are.
    put((0, 32), 448.0, 0x7E)  # 1.75 * 2**8: 0 1111 110 (0x7F would be NaN)
    put((1, 33), -448.0, 0xFE)
    put((2, 34), 240.0, 0x77)  # 1.875 * 2**7: 0 1110 111
    put((3, 35), 2.0**-9, 0x01)
    put((4, 36), 2.0**-6, 0x08)  # smallest normal: 0 0001 000
    put((5, 37), 3 * 2.0**-9, 0x03)  # subnormal 3/8 * 2**-6: 0 0000 011
    put((6, 38), 17.0, 0x58)  # 1.0625 * 2**4: tie of 16 (000) / 18 (001) -> 16
    # Block 2: amax 449 -> exponent ceil(log2(449 / 448)) = 1 -> byte 128; stored as x / 2.
    put((0, 64), 449.0, 0x76)  # 224.5 -> 224 = 1.75 * 2**7: 0 1110 110
    put((1, 65), -2.0, 0xB8)  # -1.0: 1 0111 000
    put((2, 66), 0.75, 0x2C)  # 0.375 = 1.5 * 2**-2: 0 0101 100
    for pos, value in values.items():
        w[pos] = value
    return w, expected, [[120, 127, 128]]


def test_mxfp8_known_bytes():
    w, expected, scale_bytes = known_mxfp8_weight()
    values, scale = quantize_mxfp8(w)

    assert scale.dtype == torch.float8_e8m0fnu and as_bytes(scale).tolist() == scale_bytes
    want = torch.zeros(32, 96, dtype=torch.uint8)
    for pos, byte in expected.items():
        want[pos] = byte
    assert torch.equal(as_bytes(values), want)


def test_mxfp8_known_bytes_dequantize_to_exact_floats():
    """The hand-made bytes back to floats: byte value x block scale."""
    _, expected, scale_bytes = known_mxfp8_weight()
    raw = torch.zeros(32, 96, dtype=torch.uint8)
    for pos, byte in expected.items():
        raw[pos] = byte
    out = dequantize_mxfp8(raw.view(torch.float8_e4m3fn), e8m0(scale_bytes))
    known = {
        (0, 0): 3.0,
        (1, 0): 2.0**-7,
        (2, 5): -0.5,
        (3, 7): 2.0**-16,
        (4, 9): 2.0**-7,
        (5, 11): 1.25 / 128,
        (31, 31): 13 / 128,
        (0, 32): 448.0,
        (2, 34): 240.0,
        (5, 37): 3 * 2.0**-9,
        (6, 38): 16.0,
        (0, 64): 448.0,
        (1, 65): -2.0,
        (2, 66): 0.75,
    }
    for pos, value in known.items():
        assert out[pos].item() == value, pos
    assert out[0, 1] == -3.0 and out[1, 33] == -448.0


def random_mxfp8(seed: int, rows: int = 64, cols: int = 96):
    g = torch.Generator().manual_seed(seed)
    bytes_ = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
    bytes_[(bytes_ & 0x7F) == 0x7F] = 0x42  # no NaNs
    scale = torch.randint(100, 150, (rows // 32, cols // 32), generator=g, dtype=torch.uint8)
    return bytes_.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)


def test_mxfp8_dequantize_matches_upstream_block_dequant():
    """Upstream's CPU dequantization of a block-scaled FP8 linear ([32, 32] blocks, UE8M0
    scales) gives exactly our floats."""
    dequant = upstream("vllm.models.deepseek_v4.cpu.cpu_sparse", "_dequant_linear_weight")
    values, scale = random_mxfp8(0)
    layer = SimpleNamespace(weight=values, weight_scale_inv=scale, weight_block_size=[32, 32])
    assert torch.equal(dequantize_mxfp8(values, scale), dequant(layer))


def test_mxfp8_round_trip_within_format_error():
    """Each 32x32 block's scale is the smallest power of two that fits its amax into 448;
    every value comes back within half an e4m3 step: 2**-4 relative for normals, half
    the subnormal step 2**-10 x scale below."""

    def per_block(t):  # [2, 3] -> [64, 96]
        return t.repeat_interleave(32, 0).repeat_interleave(32, 1)

    g = torch.Generator().manual_seed(1)
    magnitudes = torch.logspace(-6, 3, 6)[torch.randint(0, 6, (2, 3), generator=g)]
    w = torch.randn(64, 96, generator=g) * per_block(magnitudes)
    values, scale = quantize_mxfp8(w)
    back = dequantize_mxfp8(values, scale)
    block_scale = per_block(torch.exp2(as_bytes(scale).float() - 127))
    amax = per_block(w.abs().view(2, 32, 3, 32).amax(dim=(1, 3)))
    assert ((amax / block_scale) <= 448).all() and ((amax / block_scale) > 224).all()
    bound = torch.maximum(w.abs() * 2.0**-4, block_scale * 2.0**-10)
    assert ((back - w).abs() <= bound).all()


# --- row-wise FP8 (Engram tables): one UE8M0 scale per 32 values of a row ----------------
def test_rowwise_fp8_matches_upstream_mxfp8_helpers():
    """Quantized bytes and scales equal upstream's torch MXFP8 quantizer (same
    granularity), and dequantization equals upstream's (bf16 holds e4m3 x 2**k exactly).
    An all-zero group is left out of the byte comparison: we write scale byte 1, upstream
    0; both decode to zeros."""
    quantize_ref = upstream(MXFP8_UTILS, "_mxfp8_e4m3_quantize_torch")
    dequant_ref = upstream(MXFP8_UTILS, "dequant_mxfp8_to_bf16")
    g = torch.Generator().manual_seed(2)
    table = torch.randn(16, 128, generator=g) * torch.logspace(-5, 4, 16)[:, None]
    table[3, 64:96] = 0.0

    values, scale = quantize_rowwise_fp8(table)
    ref_values, ref_scale = quantize_ref(table)

    nonzero = torch.ones(16, 4, dtype=torch.bool)
    nonzero[3, 2] = False
    assert torch.equal(as_bytes(scale)[nonzero], ref_scale[nonzero])
    assert torch.equal(as_bytes(values), as_bytes(ref_values))
    back = dequantize_rowwise_fp8(values, scale)
    assert torch.equal(back, dequant_ref(ref_values, ref_scale).float())
    assert (back[3, 64:96] == 0).all()


# --- MXFP4 experts: e2m1 nibbles, two per byte along K, one UE8M0 scale per 32 ----------
# Codes of the 32 elements of the known row: every code once in an odd order, then 0..15.
KNOWN_CODES = [
    0x1,
    0xA,
    0x2,
    0xF,
    0x7,
    0x8,
    0x0,
    0x9,
    0x3,
    0xB,
    0x4,
    0xC,
    0x5,
    0xD,
    0x6,
    0xE,
    *range(16),
]
# byte j = code[2j] | code[2j+1] << 4 (even element in the low nibble)
KNOWN_PACKED = [
    0xA1,
    0xF2,
    0x87,
    0x90,
    0xB3,
    0xC4,
    0xD5,
    0xE6,
    0x10,
    0x32,
    0x54,
    0x76,
    0x98,
    0xBA,
    0xDC,
    0xFE,
]
# Scale byte 129 = 2**2: e2m1 value x 4 (code 8 is -0.0).
KNOWN_ROW = [
    2.0,
    -4.0,
    4.0,
    -24.0,
    24.0,
    -0.0,
    0.0,
    -2.0,
    6.0,
    -6.0,
    8.0,
    -8.0,
    12.0,
    -12.0,
    16.0,
    -16.0,
    0.0,
    2.0,
    4.0,
    6.0,
    8.0,
    12.0,
    16.0,
    24.0,
    -0.0,
    -2.0,
    -4.0,
    -6.0,
    -8.0,
    -12.0,
    -16.0,
    -24.0,
]


def known_mxfp4():
    """Row 0: the known row at scale byte 129; row 1: the same bytes at scale byte 118
    (2**-9), so each value is KNOWN_ROW / 4 / 512."""
    packed = torch.tensor([KNOWN_PACKED, KNOWN_PACKED], dtype=torch.uint8).view(torch.int8)
    expected = torch.tensor([KNOWN_ROW, [v / 2048 for v in KNOWN_ROW]])
    return packed, e8m0([[129], [118]]), expected


def test_mxfp4_known_nibbles_dequantize_to_exact_floats():
    packed, scale, expected = known_mxfp4()
    out = dequantize_mxfp4(packed, scale)
    assert torch.equal(out, expected)
    assert torch.equal(torch.signbit(out), torch.signbit(expected))  # -0.0 kept


def test_mxfp4_dequantize_matches_upstream_helpers():
    """Upstream's MXFP4 expert dequantization (UE8M0, 32 per scale) and its e2m1 nibble
    decoder agree with ours on the known bytes and on random bytes and scales."""
    dequant_ref = upstream(
        "vllm.model_executor.layers.fused_moe.flashinfer_moe_ep", "_dequant_mxfp4_ue8m0_gran32"
    )
    break_bytes = upstream(NVFP4_UTILS, "break_fp4_bytes")
    packed, scale, expected = known_mxfp4()
    assert torch.equal(dequant_ref(packed, scale).float(), expected)
    e2m1_values = expected[:1].expand(2, -1) / 4  # the known row without its scale
    assert torch.equal(break_bytes(packed.view(torch.uint8), torch.float32), e2m1_values)

    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (8, 64), generator=g, dtype=torch.uint8).view(torch.int8)
    scale = torch.randint(110, 145, (8, 4), generator=g, dtype=torch.uint8)
    scale = scale.view(torch.float8_e8m0fnu)
    assert torch.equal(dequantize_mxfp4(packed, scale), dequant_ref(packed, scale).float())


def test_mxfp4_known_row_quantizes_to_known_bytes():
    """The known row without its -0.0 entries (a float -0.0 has no unique code) quantizes
    to the known nibbles: amax 24 -> exponent ceil(log2(24 / 6)) = 2 -> byte 129."""
    row = torch.tensor([KNOWN_ROW])
    row[row == 0] = 0.0  # -0.0 -> +0.0, code 0
    codes = [0 if c == 0x8 else c for c in KNOWN_CODES]
    packed, scale = quantize_mxfp4(row)
    assert as_bytes(scale).tolist() == [[129]]
    assert as_bytes(packed).tolist() == [[codes[2 * j] | codes[2 * j + 1] << 4 for j in range(16)]]


def test_mxfp4_rounding_matches_upstream_e2m1_cast():
    """Every multiple of 1/8 in [-6, 6] at scale 1 (each group holds a 6.0): the nearest
    e2m1 value, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    2.5 -> 2, 3.5 -> 4, 5 -> 4), as upstream's cast_to_fp4 rounds."""
    cast_to_fp4 = upstream(NVFP4_UTILS, "cast_to_fp4")
    grid = torch.arange(-48, 49, dtype=torch.float32) / 8
    w = torch.full((4, 32), 6.0)
    w.view(-1)[:97] = grid
    w[:, 31] = 6.0
    packed, scale = quantize_mxfp4(w)
    assert (as_bytes(scale) == 127).all()
    ours = dequantize_mxfp4(packed, scale)
    expected = cast_to_fp4(w.clone())
    wrong = ours != expected
    assert not wrong.any(), (
        f"inputs {w[wrong].tolist()} -> ours {ours[wrong].tolist()}, "
        f"upstream {expected[wrong].tolist()}"
    )


def test_mxfp4_round_trip_within_format_error():
    """Per 32 values the scale is the smallest power of two that fits amax into 6; each
    value comes back within half the e2m1 gap around it: 0.25 below 2, 0.5 up to 4, 1 up
    to 6 (x scale), i.e. within max(scale / 4, |x| / 4)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(16, 128, generator=g) * torch.logspace(-4, 3, 16)[:, None]
    packed, scale = quantize_mxfp4(w)
    back = dequantize_mxfp4(packed, scale)
    group_scale = torch.exp2(as_bytes(scale).float() - 127).repeat_interleave(32, 1)
    amax = w.abs().view(16, 4, 32).amax(-1).repeat_interleave(32, 1)
    assert ((amax / group_scale) <= 6).all() and ((amax / group_scale) > 3).all()
    assert ((back - w).abs() <= torch.maximum(group_scale / 4, w.abs() / 4)).all()
