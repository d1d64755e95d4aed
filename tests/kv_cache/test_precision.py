"""The global-KV records of vllm_deepinfer/kv_cache/precision.py against their definitions:
sizes, hand-derived bytes, rounding error bounds, exact values, saturation, the settings
that choose them and the bytes a token costs.

Byte facts used below: e4m3fn = sign, 4 exponent bits (bias 7), 3 mantissa bits, so
1.0 = 0x38, 448 = 0x7E; UE8M0 byte b = 2**(b - 127); e2m1 codes 0..7 = 0, .5, 1, 1.5, 2,
3, 4, 6 with bit 3 the sign, dim 2k in a byte's low nibble. Upstream's CPU helpers
(`_mxfp8_e4m3_quantize_torch`, `cast_to_fp4`, `break_fp4_bytes`) are cross-checks; the
record writers themselves are Triton kernels with no CPU path.
"""

from types import SimpleNamespace

import pytest
import torch

from fixtures.tiny import TEXT_CONFIG
from helpers import upstream
from vllm_deepinfer.kv_cache.precision import (
    FP8_INDEX_KEY,
    MXFP4_INDEX_KEY,
    MXFP8_LATENT,
    NVFP4_LATENT,
    V4_FP8_LATENT,
    index_key_format,
    latent_format,
    persisted_bytes_per_token,
)
from vllm_deepinfer.model.deepseek_v41.args import V41Args

pytestmark = pytest.mark.unit

FORMATS = [NVFP4_LATENT, MXFP8_LATENT, V4_FP8_LATENT, MXFP4_INDEX_KEY, FP8_INDEX_KEY]
# Where each record's scales start, and how they are stored.
SCALES_AT = {
    NVFP4_LATENT: (256, "e4m3"),
    MXFP8_LATENT: (512, "ue8m0"),
    V4_FP8_LATENT: (576, "ue8m0"),
    MXFP4_INDEX_KEY: (64, "ue8m0"),
    FP8_INDEX_KEY: (128, "fp32"),
}
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MXFP8_UTILS = "vllm.model_executor.layers.quantization.utils.mxfp8_utils"
NVFP4_UTILS = "vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils"


def fmt_id(fmt) -> str:
    return f"{fmt.name}-{fmt.record_bytes}"


def quantized(fmt, x: torch.Tensor) -> torch.Tensor:
    return x[..., : fmt.width - fmt.rope_dims]


def normal(width: int, seed: int, rows: int = 64) -> torch.Tensor:
    """Normal rows at magnitudes 1e-3 .. 1e3."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g) * 10 ** (torch.rand(rows, 1, generator=g) * 6 - 3)


def with_outliers(width: int, seed: int) -> torch.Tensor:
    x = normal(width, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return torch.where(torch.rand(x.shape, generator=g) < 0.02, x * 300, x)


def expected_scales(fmt, x: torch.Tensor) -> torch.Tensor:
    """Each block's scale by the format's rule, in float64: NVFP4 amax / 6 as e4m3 within
    [2**-9, 448]; the others the power of two 2**ceil(log2(amax / max)), amax floored."""
    blocks = quantized(fmt, x).double().unflatten(-1, (-1, fmt.block))
    amax = blocks.abs().amax(-1)
    if fmt is NVFP4_LATENT:
        return (amax / 6).clamp(2.0**-9, 448).to(torch.float8_e4m3fn).double()
    top, floor = (6.0, 6 * 2.0**-126) if fmt is MXFP4_INDEX_KEY else (448.0, 1e-4)
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(floor) / top)))


def stored_scales(fmt, records: torch.Tensor) -> torch.Tensor:
    start, kind = SCALES_AT[fmt]
    count = (fmt.width - fmt.rope_dims) // fmt.block
    raw = records[..., start : start + count * (4 if kind == "fp32" else 1)]
    if kind == "ue8m0":
        return torch.exp2(raw.double() - 127)
    dtype = torch.float32 if kind == "fp32" else torch.float8_e4m3fn
    return raw.contiguous().view(dtype).double()


# --- sizes ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fmt, size", list(zip(FORMATS, (288, 528, 584, 68, 132))), ids=[fmt_id(f) for f in FORMATS]
)
def test_records_have_their_sizes(fmt, size):
    assert fmt.record_bytes == size
    records = fmt.encode(normal(fmt.width, 0, rows=6))
    assert records.dtype == torch.uint8 and records.shape == (6, size)
    nested = fmt.encode(normal(fmt.width, 0, rows=6).reshape(2, 3, fmt.width))
    assert torch.equal(nested, records.reshape(2, 3, size))
    decoded = fmt.decode(nested, dtype=torch.bfloat16)
    assert decoded.dtype == torch.bfloat16 and decoded.shape == (2, 3, fmt.width)


def test_wrong_shapes_are_refused():
    with pytest.raises(ValueError, match="512"):
        MXFP8_LATENT.encode(torch.zeros(2, 128))
    with pytest.raises(ValueError, match="68"):
        MXFP4_INDEX_KEY.decode(torch.zeros(2, 132, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        FP8_INDEX_KEY.decode(torch.zeros(2, 132))


# --- hand-derived bytes ----------------------------------------------------------------
def test_nvfp4_latent_known_bytes():
    x = torch.zeros(512)
    # Block 0: amax 6 -> scale 6/6 = 1.0 (0x38); the e2m1 ties 0.25, 1.25, 2.5, 5 round
    # down and 0.75, 1.75, 3.5 up (to the even code); -0.25 rounds to -0 (code 8).
    x[:16] = torch.tensor(
        [6, -6, 3, 0.5, 0, -0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -1, 1.5, -2, 4]
    )
    # Block 1: amax 1.5 -> scale 0.25 (0x28): 1.5 -> 6 (code 7), -0.75 -> -3 (code 0xD).
    x[16:18] = torch.tensor([1.5, -0.75])
    # Block 2: amax 6 s, s = 1.875 * 2**-6 (0x0F), and the ties 1.25 s, 2.5 s, which only
    # an exact x / s (not x * (1 / s)) lands on: 6 -> 7, 1.25 -> 2, 2.5 -> 4.
    s = 1.875 * 2**-6
    x[32:35] = torch.tensor([6 * s, 1.25 * s, 2.5 * s])
    expected = torch.zeros(288, dtype=torch.uint8)
    expected[:9] = torch.tensor([0xF7, 0x15, 0x80, 0x22, 0x44, 0x66, 0x3A, 0x6C, 0xD7])
    expected[16:18] = torch.tensor([0x27, 0x04])
    # All-zero blocks keep the smallest scale, 2**-9 (e4m3 subnormal 0x01).
    expected[256:] = 0x01
    expected[256:259] = torch.tensor([0x38, 0x28, 0x0F])
    assert NVFP4_LATENT.encode(x).tolist() == expected.tolist()


def test_mxfp8_latent_known_bytes():
    x = torch.zeros(512)
    # Block 0: amax 448 -> scale 2**0 (byte 127); 448 = 0x7E, -1 = 0xB8, 0.5 = 0x30,
    # 3 = 1.5 * 2 = 0x44; the ties 1.0625 and 1.1875 round to the even mantissa (1.0, 1.25).
    x[:6] = torch.tensor([448, -1, 0.5, 3, 1.0625, 1.1875])
    # Block 1: amax 1 -> 2**ceil(log2(1/448)) = 2**-8 (byte 119); 1 * 256 = 2**8 = 0x78,
    # 0.75 * 256 = 1.5 * 2**7 = 0x74.
    x[32:34] = torch.tensor([1.0, 0.75])
    expected = torch.zeros(528, dtype=torch.uint8)
    expected[:6] = torch.tensor([0x7E, 0xB8, 0x30, 0x44, 0x38, 0x3A])
    expected[32:34] = torch.tensor([0x78, 0x74])
    # Zero blocks: amax floored to 1e-4 -> 2**ceil(log2(1e-4 / 448)) = 2**-22 (byte 105).
    expected[512:] = 105
    expected[512:514] = torch.tensor([127, 119])
    assert MXFP8_LATENT.encode(x).tolist() == expected.tolist()


def test_v4_latent_known_bytes():
    x = torch.zeros(512)
    x[:2] = torch.tensor([448, -1])  # block 0 of 64 dims: scale 2**0, bytes 0x7E 0xB8
    # RoPE dims are bf16, little-endian: 1.0 = 0x3F80, -2.0 = 0xC000; their size sets no
    # scale.
    x[448:451] = torch.tensor([1.0, -2.0, 1e6])
    expected = torch.zeros(584, dtype=torch.uint8)
    expected[:2] = torch.tensor([0x7E, 0xB8])
    expected[448:452] = torch.tensor([0x80, 0x3F, 0x00, 0xC0])
    expected[452:454] = torch.tensor(torch.tensor([1e6]).bfloat16().view(torch.uint8).tolist())
    expected[576:583] = 105  # 7 UE8M0 scales, zero blocks at 2**-22, then one zero pad byte
    expected[576] = 127
    assert V4_FP8_LATENT.encode(x).tolist() == expected.tolist()


def test_mxfp4_index_key_known_bytes():
    x = torch.zeros(128)
    # Block 0: amax 6 -> 2**ceil(log2(6/6)) = 1 (byte 127); 6 -> 7, -3 -> 0xD, 0.25 -> 0
    # (tie, down), 0.75 -> 2 (tie, up).
    x[:4] = torch.tensor([6, -3, 0.25, 0.75])
    # Block 1: amax 1 -> 2**ceil(log2(1/6)) = 2**-2 (byte 125); 1 / 0.25 = 4 -> code 6.
    x[32] = 1.0
    expected = torch.zeros(68, dtype=torch.uint8)
    expected[:2] = torch.tensor([0xD7, 0x20])
    expected[16] = 0x06
    # Zero blocks: amax floored to 6 * 2**-126 -> 2**-126 (byte 1).
    expected[64:] = torch.tensor([127, 125, 1, 1])
    assert MXFP4_INDEX_KEY.encode(x).tolist() == expected.tolist()


def test_fp8_index_key_known_bytes():
    x = torch.zeros(128)
    # amax 2 -> 2**ceil(log2(2/448)) = 2**-7; 2 * 128 = 2**8 = 0x78, -1 * 128 = -2**7 =
    # 0xF0, 0.25 * 128 = 2**5 = 0x60; the scale is fp32 2**-7 = 0x3C000000, little-endian.
    x[:3] = torch.tensor([2.0, -1.0, 0.25])
    expected = torch.zeros(132, dtype=torch.uint8)
    expected[:3] = torch.tensor([0x78, 0xF0, 0x60])
    expected[128:] = torch.tensor([0, 0, 0, 0x3C])
    assert FP8_INDEX_KEY.encode(x).tolist() == expected.tolist()


# --- rounding ---------------------------------------------------------------------------
@pytest.mark.parametrize("data", [normal, with_outliers])
@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_round_trip_is_within_half_a_step(fmt, data):
    """Scales follow the rule; every value is off by at most half a step of its format
    at its block's scale s: e4m3 half an ulp, <= |x| 2**-4 (subnormals: s 2**-10); e2m1
    <= |x| / 4 (above 1) or s / 4. NVFP4's s is amax / 6 rounded to e4m3, which can
    fall short of it (by 1/16 when normal, by up to half below 2**-6, the 1e-3 rows, and
    without bound past 448, the outliers and 1e3 rows): values beyond 6 s decode as 6 s."""
    x = data(fmt.width, seed=len(fmt.name) + fmt.record_bytes)
    records = fmt.encode(x)
    scale = expected_scales(fmt, x)
    assert torch.equal(stored_scales(fmt, records), scale)

    q = quantized(fmt, x).double()
    s = scale.repeat_interleave(fmt.block, -1)
    decoded = fmt.decode(records).double()
    error = (quantized(fmt, decoded) - q).abs()
    if fmt.values == "e2m1":
        bound = torch.maximum(q.abs() / 4, s / 4)
    else:
        bound = torch.maximum(q.abs() * 2.0**-4, s * 2.0**-10)
    saturated = q.abs() > (6 * s if fmt.values == "e2m1" else torch.inf)
    assert torch.equal(error[saturated], (q.abs() - 6 * s)[saturated])
    assert (error <= bound * (1 + 1e-6))[~saturated].all()
    assert torch.equal(decoded[..., q.shape[-1] :], x[..., q.shape[-1] :].bfloat16().double())


def representable(fmt, seed: int, rows: int = 16) -> torch.Tensor:
    """Rows whose every block is format values times the scale its amax selects: the
    largest value +-448 (e4m3) or +-6 (e2m1) times a power of two (NVFP4: an e4m3 scale)."""
    g = torch.Generator().manual_seed(seed)
    n = fmt.width - fmt.rope_dims
    shape = (rows, n // fmt.block, fmt.block)
    if fmt.values == "e4m3":
        raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0  # no NaNs
        values = raw.view(torch.float8_e4m3fn).float()
        values[..., 0] = 448.0
    else:
        values = E2M1[torch.randint(0, 8, shape, generator=g)]
        values[..., 0] = 6.0
    values *= torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    if fmt is NVFP4_LATENT:  # normal e4m3 scales, 2**-6 .. 448
        scale = torch.randint(0x08, 0x7F, shape[:2] + (1,), generator=g, dtype=torch.uint8)
        scale = scale.view(torch.float8_e4m3fn).float()
    else:
        scale = torch.exp2(torch.randint(-20, 20, shape[:2] + (1,), generator=g).float())
    rope = torch.randn(rows, fmt.rope_dims, generator=g).bfloat16().float()
    return torch.cat([(values * scale).flatten(-2), rope], -1)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_representable_values_decode_exactly(fmt):
    x = representable(fmt, seed=fmt.record_bytes)
    assert torch.equal(fmt.decode(fmt.encode(x)), x)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_zeros_decode_to_zeros(fmt):
    x = torch.zeros(3, fmt.width)
    x[1] = -0.0
    decoded = fmt.decode(fmt.encode(x))
    assert not decoded.isnan().any() and torch.equal(decoded.abs(), x.abs())


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_large_values_stay_finite(fmt):
    """Power-of-two scales grow with amax (up to 2**119 for e4m3); NVFP4's e4m3 scale stops
    at 448, so its values saturate at 6 * 448."""
    x = normal(fmt.width, seed=5, rows=4) * 1e30
    decoded = fmt.decode(fmt.encode(x))
    assert decoded.isfinite().all()
    if fmt is NVFP4_LATENT:
        assert decoded.abs().max() == 6 * 448
        assert torch.equal(decoded.sign(), torch.where(decoded == 0, 0, x.sign()))
    else:
        n = fmt.width - fmt.rope_dims
        limit = 0.25 if fmt.values == "e2m1" else 2.0**-4
        assert ((decoded[:, :n] - x[:, :n]).abs() <= x[:, :n].abs().amax() * limit).all()


# --- against upstream's CPU helpers -----------------------------------------------------
@pytest.mark.parametrize("data", [normal, with_outliers])
def test_mxfp8_latent_matches_upstream_torch_mxfp8(data):
    """vLLM's naive MXFP8 quantizer picks the same 32-dim UE8M0 scales and e4m3 bytes
    (it divides by 448 where the kernel multiplies by 1/448: equal away from exact ties)."""
    quantize = upstream(MXFP8_UTILS, "_mxfp8_e4m3_quantize_torch")
    x = data(512, seed=11)
    values, scales = quantize(x)
    records = MXFP8_LATENT.encode(x)
    assert torch.equal(records[:, :512], values.view(torch.uint8))
    assert torch.equal(records[:, 512:], scales)


@pytest.mark.parametrize("fmt", [NVFP4_LATENT, MXFP4_INDEX_KEY], ids=fmt_id)
def test_e2m1_nibbles_match_upstream_cast_and_unpack(fmt):
    """Every e2m1 midpoint and value (x / s = k / 4, |k| <= 24) rounds as vLLM's
    `cast_to_fp4` does, and `break_fp4_bytes` reads our nibbles in the same order."""
    cast_to_fp4 = upstream(NVFP4_UTILS, "cast_to_fp4")
    break_fp4_bytes = upstream(NVFP4_UTILS, "break_fp4_bytes")
    g = torch.Generator().manual_seed(3)
    steps = torch.arange(-24, 25)[torch.randint(0, 49, (32, fmt.width), generator=g)] / 4
    steps[:, :: fmt.block] = 6.0  # every block's amax is 6: scale 1
    records = fmt.encode(steps)
    nibbles = records[:, : fmt.width // 2]
    assert torch.equal(break_fp4_bytes(nibbles, torch.float32), cast_to_fp4(steps.clone()))
    assert torch.equal(fmt.decode(records), cast_to_fp4(steps.clone()))


# --- choosing formats, and what they cost -----------------------------------------------
def test_latent_format_choices():
    for dtype in ("auto", "bfloat16", "float32", "float16"):
        assert latent_format(dtype) is None
    assert latent_format("nvfp4_ds_mla") is NVFP4_LATENT
    # V4.1's own record (upstream writes the 584 B V4 one only where FlashMLA can't read it).
    assert latent_format("fp8_ds_mla") is MXFP8_LATENT
    for bad in ("fp8", "fp8_e4m3", "nvfp4", ""):
        with pytest.raises(ValueError, match="nvfp4_ds_mla"):
            latent_format(bad)


def test_index_key_format_choices():
    for dtype in (None, "auto", "bfloat16", "bf16"):
        assert index_key_format(dtype) is None
    assert index_key_format("fp8") is FP8_INDEX_KEY
    assert index_key_format("mxfp4") is MXFP4_INDEX_KEY
    for bad in ("nvfp4", "fp8_ds_mla", "float16"):
        with pytest.raises(ValueError, match="mxfp4"):
            index_key_format(bad)


def stand_in_args(ratios: dict[int, int]) -> SimpleNamespace:
    return SimpleNamespace(
        kv_source_layer_ids=tuple(ratios),
        ratio=ratios.__getitem__,
        head_dim=512,
        index_head_dim=128,
    )


FLASH_LIKE = stand_in_args({2: 2, 8: 2, 14: 2, 20: 1})
TINY_LIKE = stand_in_args({2: 2, 4: 2, 6: 1})


def test_persisted_bytes_per_token():
    # (288 + 68) B per latent and key, one per 2, 2, 2, 1 tokens: 356 * 2.5.
    assert persisted_bytes_per_token(FLASH_LIKE, NVFP4_LATENT, MXFP4_INDEX_KEY, 2) == 890.0
    assert persisted_bytes_per_token(TINY_LIKE, NVFP4_LATENT, MXFP4_INDEX_KEY, 2) == 712.0
    # bf16: 2 states a token, each 512 * 2 + 128 * 2 B.
    assert persisted_bytes_per_token(TINY_LIKE, None, None, 2) == 2.0 * (512 * 2 + 128 * 2)
    assert persisted_bytes_per_token(TINY_LIKE, MXFP8_LATENT, FP8_INDEX_KEY, 2) == 2 * 660
    tiny = V41Args.from_hf_config(
        SimpleNamespace(
            **TEXT_CONFIG, engram_compressed_vocab_size=1000, engram_num_embeddings=[5000, 5000]
        )
    )
    assert persisted_bytes_per_token(tiny, NVFP4_LATENT, MXFP4_INDEX_KEY, 2) == 712.0
