"""The tiled MXFP4/MXFP8 matmul against its torch twin: the whole weight dequantized by
the checkpoint's own decoders (checkpoint/mx_formats.py), then one matmul."""

import pytest
import torch

from vllm_deepinfer.checkpoint.mx_formats import (
    dequantize_mxfp4,
    dequantize_mxfp8,
    quantize_mxfp4,
    quantize_mxfp8,
)
from vllm_deepinfer.kernels.mx_matmul import TILE_ROWS, dequantized_rows, mx_linear_tiled

pytestmark = pytest.mark.unit

FORMATS = {
    "mxfp4": (quantize_mxfp4, dequantize_mxfp4, True),
    "mxfp8": (quantize_mxfp8, dequantize_mxfp8, False),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_features", [64, TILE_ROWS + 96])  # one tile; a partial last one
def test_tiled_product_equals_the_whole_dequantized_weight(fmt, dtype, out_features):
    quantize, dequantize, mxfp4 = FORMATS[fmt]
    g = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 128, generator=g) * 0.05
    values, scale = quantize(weight)
    twin = dequantize(values, scale)
    for start, stop in ((0, 32), (32, out_features)):
        rows = dequantized_rows(values, scale.view(torch.uint8), start, stop, mxfp4, dtype)
        assert rows.dtype == dtype
        torch.testing.assert_close(rows, twin[start:stop].to(dtype), rtol=0, atol=0)
    x = torch.randn(5, 3, 128, generator=g).to(dtype)
    got = mx_linear_tiled(x, values, scale.view(torch.uint8), mxfp4)
    expected = torch.nn.functional.linear(x, twin.to(dtype))
    assert got.shape == (5, 3, out_features) and got.dtype == dtype
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


def test_the_product_never_holds_more_than_one_tile_wide(monkeypatch):
    """Each dequantized piece is at most TILE_ROWS rows: the weight itself stays packed."""
    import vllm_deepinfer.kernels.mx_matmul as mx

    widths = []
    original = mx.dequantized_rows

    def recording(values, scale, start, stop, mxfp4, dtype=torch.float32):
        widths.append(stop - start)
        return original(values, scale, start, stop, mxfp4, dtype)

    monkeypatch.setattr(mx, "dequantized_rows", recording)
    values, scale = quantize_mxfp4(torch.randn(3 * TILE_ROWS + 32, 64))
    mx.mx_linear_tiled(torch.randn(2, 64), values, scale, True)
    assert widths == [TILE_ROWS, TILE_ROWS, TILE_ROWS, 32]
