"""The plugin's C kernel for decode-sized products (kernels/weight_gemv.py) against its torch
twins: the checkpoint's own decoders (checkpoint/mx_formats.py) then a float64 matmul,
for the SIMD build of this CPU and a baseline build that runs the portable C path."""

import platform

import pytest
import torch
import torch.nn.functional as F

from vllm_deepinfer.checkpoint.mx_formats import (
    dequantize_mxfp4,
    dequantize_mxfp8,
    quantize_mxfp4,
    quantize_mxfp8,
)
from vllm_deepinfer.kernels import cpu_build, mx_matmul, weight_gemv
from vllm_deepinfer.kernels.weight_gemv import BF16, MXFP4, MXFP8

pytestmark = pytest.mark.unit

BUILDS = [cpu_build.NATIVE] + (["x86-64"] if platform.machine() == "x86_64" else [])
FORMATS = {
    "mxfp4": (quantize_mxfp4, dequantize_mxfp4, MXFP4),
    "mxfp8": (quantize_mxfp8, dequantize_mxfp8, MXFP8),
}


def built(march: str):
    library = weight_gemv.library(march)
    if library is None:
        pytest.skip("no C compiler on this machine: the kernel is not built")
    return library


def stored(fmt: str, out_features: int, k: int, seed: int):
    quantize, dequantize, code = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    values, scale = quantize(torch.randn(out_features, k, generator=g) * 0.05)
    scale = scale.view(torch.uint8)
    return values, scale, dequantize(values, scale), code


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, weight_gemv.MAX_ROWS])
def test_product_equals_the_dequantized_twin(march, fmt, rows):
    library = built(march)
    if march == cpu_build.NATIVE and platform.machine() == "x86_64":
        assert library.weight_gemv_simd() == int(
            torch.backends.cpu.get_cpu_capability() != "DEFAULT"
        )
    if march != cpu_build.NATIVE:
        assert library.weight_gemv_simd() == 0  # the portable path
    values, scale, twin, code = stored(fmt, 96, 256, rows)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    got = weight_gemv.product(x, values, scale, code, library)
    expected = F.linear(x.double(), twin.double())
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_and_scale_is_widened_exactly(march, fmt):
    """One-hot activations read single weights back: every stored code at every scale
    byte whose values stay finite in fp32 (up to 246: e4m3's 448 times 2**119), subnormal
    results included, equals the checkpoint's decoding."""
    library = built(march)
    g = torch.Generator().manual_seed(0)
    out_features, k = 64, 256
    if fmt == "mxfp4":
        values = torch.randint(0, 256, (out_features, k // 2), generator=g, dtype=torch.uint8)
        scale = torch.randint(0, 247, (out_features, k // 32), generator=g, dtype=torch.uint8)
        twin = dequantize_mxfp4(values.view(torch.int8), scale)
    else:
        values = torch.randint(0, 256, (out_features, k), generator=g, dtype=torch.uint8)
        values[(values & 0x7F) == 0x7F] = 0  # e4m3fn's NaN codes
        scale = torch.randint(0, 247, (out_features // 32, k // 32), generator=g, dtype=torch.uint8)
        values = values.view(torch.float8_e4m3fn)
        twin = dequantize_mxfp8(values, scale)
    got = weight_gemv.product(torch.eye(k), values, scale, FORMATS[fmt][2], library)
    assert torch.equal(got, twin.T.float())


@pytest.mark.parametrize("march", BUILDS)
def test_bf16_weights(march):
    library = built(march)
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(200, 128, generator=g).bfloat16()
    x = torch.randn(5, 128, generator=g).bfloat16()
    got = weight_gemv.product(x, weight, None, BF16, library)
    assert got.dtype == torch.bfloat16
    expected = F.linear(x.double(), weight.double()).bfloat16()
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    assert torch.equal(
        weight_gemv.product(torch.eye(128), weight, None, BF16, library), weight.T.float()
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_does_not_depend_on_the_batch_it_runs_in(fmt):
    """Rows alone, in pairs (weights shared in registers) and in larger batches (widened
    once into a row buffer) give bit-identical results."""
    library = built(cpu_build.NATIVE)
    values, scale, _, code = stored(fmt, 64, 512, 3)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(4))
    together = weight_gemv.product(x, values, scale, code, library)
    for row in range(9):
        alone = weight_gemv.product(x[row : row + 1], values, scale, code, library)
        assert torch.equal(alone[0], together[row])
    assert torch.equal(weight_gemv.product(x[:2], values, scale, code, library), together[:2])


def test_an_experts_slice_of_a_stack_is_read_in_place():
    """Experts are slices of one stacked parameter: strided rows, no copy."""
    library = built(cpu_build.NATIVE)
    values, scale, twin, _ = stored("mxfp4", 3 * 64, 128, 5)
    stack_values, stack_scale = values.view(3, 64, 64), scale.view(3, 64, 4)
    x = torch.randn(2, 128)
    got = weight_gemv.product(x, stack_values[1], stack_scale[1], MXFP4, library)
    torch.testing.assert_close(got, x @ twin[64:128].T, rtol=1e-5, atol=1e-5)
    # A column share of a row (a TP rank's) strides rows by more than its own width.
    wide_values, wide_scale, wide_twin, _ = stored("mxfp4", 32, 256, 6)
    half = weight_gemv.product(x, wide_values[:, :64], wide_scale[:, :4], MXFP4, library)
    torch.testing.assert_close(half, x @ wide_twin[:, :128].T, rtol=1e-5, atol=1e-5)


def test_mx_linear_takes_the_kernel_for_decode_and_the_tiles_for_prefill(monkeypatch):
    built(cpu_build.NATIVE)
    values, scale, twin, _ = stored("mxfp8", 64, 128, 7)
    calls = []
    original = weight_gemv.product
    monkeypatch.setattr(
        weight_gemv, "product", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    for rows, kernel in (
        (1, True),
        (weight_gemv.MAX_ROWS, True),
        (weight_gemv.MAX_ROWS + 1, False),
    ):
        calls.clear()
        x = torch.randn(rows, 128)
        got = mx_matmul.mx_linear(x, values, scale, False)
        torch.testing.assert_close(got, x @ twin.T, rtol=1e-5, atol=1e-5)
        assert bool(calls) == kernel
    # Batch-invariant mode's product and DEEPINFER_MX_KERNEL=tiled keep the tiles.
    calls.clear()
    mx_matmul.mx_linear(torch.randn(1, 128), values, scale, False, F.linear)
    monkeypatch.setenv("DEEPINFER_MX_KERNEL", "tiled")
    weight_gemv.enabled.cache_clear()
    try:
        mx_matmul.mx_linear(torch.randn(1, 128), values, scale, False)
    finally:
        weight_gemv.enabled.cache_clear()
    assert not calls


def test_no_compiler_leaves_the_torch_path(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("DEEPINFER_KERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(cpu_build.shutil, "which", lambda name: None)
    assert cpu_build.load.__wrapped__("weight_gemv") is None
    assert not list(tmp_path.iterdir())


def test_a_failing_build_is_logged_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_KERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "FLAGS", ("-this-flag-does-not-exist",))
    assert cpu_build.load.__wrapped__("weight_gemv") is None
    assert not list(tmp_path.iterdir())


def test_a_build_is_cached_by_source_and_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_KERNEL_CACHE_DIR", str(tmp_path))
    if cpu_build.load.__wrapped__("weight_gemv") is None:
        pytest.skip("no C compiler on this machine")
    (first,) = tmp_path.iterdir()
    stamp = first.stat().st_mtime_ns
    assert cpu_build.load.__wrapped__("weight_gemv") is not None
    (again,) = tmp_path.iterdir()
    assert again == first and again.stat().st_mtime_ns == stamp


def expert_stacks(fmt: str, experts: int, hidden: int, inter: int, seed: int):
    """(format code, w13, w2 as the kernel reads them, their fp64 twins): a stack of
    experts stored dense (fp32, bf16) or as MXFP4 values and scales."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.1
    if fmt in ("float32", "bfloat16"):
        dtype = getattr(torch, fmt)
        w13, w2 = w13.to(dtype), w2.to(dtype)
        return weight_gemv.DENSE_FORMATS[dtype], (w13, None), (w2, None), w13.double(), w2.double()
    stacks, twins = [], []
    for w in (w13, w2):  # quantized as 2-D rows, then viewed as the stack
        values, scale = quantize_mxfp4(w.reshape(-1, w.shape[2]))
        scale = scale.view(torch.uint8)
        twins.append(dequantize_mxfp4(values, scale).double().view(w.shape))
        stacks.append((values.view(experts, w.shape[1], -1), scale.view(experts, w.shape[1], -1)))
    return MXFP4, stacks[0], stacks[1], twins[0], twins[1]


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "mxfp4"])
@pytest.mark.parametrize("tokens,k", [(1, 2), (3, 6), (17, 2)])
def test_routed_experts_equal_the_grouped_torch_path(march, fmt, tokens, k):
    """The fused kernel against the model's grouped experts (moe.py) on the same weights
    widened to float64, V4.1's clamp active (limit 1.5 on activations of about 3)."""
    from types import SimpleNamespace

    from vllm_deepinfer.model.deepseek_v41.moe import grouped_experts

    library = built(march)
    experts, hidden, inter, limit = 8, 128, 64, 1.5
    code, w13, w2, twin13, twin2 = expert_stacks(fmt, experts, hidden, inter, tokens)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(tokens, hidden, generator=g) * 3
    chosen = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    got = weight_gemv.routed_experts(x, chosen, weights, code, w13, w2, limit, library)
    stack = SimpleNamespace(
        w13=twin13, w2=twin2, count=experts, method=SimpleNamespace(stacked_product=True)
    )
    expected = grouped_experts(x.double(), weights.double(), chosen, stack, limit)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("fmt", ["bfloat16", "mxfp4"])
def test_routed_experts_of_a_token_do_not_depend_on_the_batch(march, fmt):
    """Pairs that share an expert run through its rows together: a token's output has the
    same bits alone as among 20 tokens whose pairs crowd the same experts."""
    library = built(march)
    experts, hidden, inter, tokens, k = 4, 64, 32, 20, 2
    code, w13, w2, *_ = expert_stacks(fmt, experts, hidden, inter, tokens)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, hidden, generator=g)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    batch = weight_gemv.routed_experts(x, chosen, weights, code, w13, w2, 1.5, library)
    for t in (0, 7, 19):
        alone = weight_gemv.routed_experts(
            x[t : t + 1], chosen[t : t + 1], weights[t : t + 1], code, w13, w2, 1.5, library
        )
        assert torch.equal(alone[0], batch[t])


def test_the_model_takes_the_fused_experts_for_decode_sized_batches():
    """Up to MAX_KERNEL_PAIRS (token, slot) pairs of a format the kernel reads; larger
    batches, unknown formats and DEEPINFER_MX_KERNEL=tiled keep the grouped path."""
    from types import SimpleNamespace

    from vllm_deepinfer.model.deepseek_v41.moe import MAX_KERNEL_PAIRS, few_pairs_kernel
    from vllm_deepinfer.model.deepseek_v41.quantization import RoutedExpertsMethod

    built(cpu_build.NATIVE)
    _, (w13, _), (w2, _), *_ = expert_stacks("float32", 4, 64, 32, 0)
    experts = SimpleNamespace(w13=w13, w2=w2, method=RoutedExpertsMethod())
    x = torch.randn(MAX_KERNEL_PAIRS // 2, 64)
    chosen = torch.zeros(x.shape[0], 2, dtype=torch.int64)
    assert few_pairs_kernel(x, chosen, experts)[0] == weight_gemv.F32
    assert (
        few_pairs_kernel(torch.randn(x.shape[0] + 1, 64), chosen[:1].expand(33, 2), experts) is None
    )
    experts.w13 = w13.half()
    assert few_pairs_kernel(x, chosen, experts) is None


def test_an_expert_outside_the_stack_is_refused():
    """The kernel reads each pair's expert by address: an index outside the stack fails
    the call instead of reading past it."""
    library = built(cpu_build.NATIVE)
    code, w13, w2, *_ = expert_stacks("float32", 4, 64, 32, 1)
    for bad in (4, -1):
        with pytest.raises(IndexError, match="outside the 4 held"):
            weight_gemv.routed_experts(
                torch.randn(1, 64), torch.tensor([[0, bad]]), torch.ones(1, 2), code, w13, w2,
                1.0, library,
            )  # fmt: skip
