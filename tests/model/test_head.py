"""The V4.1 head's product (model.py's UntiedHeadMethod): which kernel multiplies a bf16
head, and that every path gives the fp32 product's logits."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from vllm_deepinfer.kernels import weight_gemv
from vllm_deepinfer.model.deepseek_v41 import model
from vllm_deepinfer.model.deepseek_v41.model import UntiedHeadMethod

pytestmark = pytest.mark.unit

VOCAB, HIDDEN = 4096, 256


@pytest.fixture
def head():
    if weight_gemv.library() is None:
        pytest.skip("no C compiler on this machine: the kernel is not built")
    g = torch.Generator().manual_seed(7)
    layer = nn.Module()
    layer.weight = nn.Parameter(
        torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16), requires_grad=False
    )
    method = UntiedHeadMethod()
    method.process_weights_after_loading(layer)
    return method, layer


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    product = weight_gemv.product

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return product(x, *args, **kwargs)

    monkeypatch.setattr(weight_gemv, "product", counted)
    return calls


def rows(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)


def close_to_fp32(logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    expected = F.linear(x.float(), weight.float())
    assert logits.dtype == torch.bfloat16 and logits.shape == expected.shape
    # Accumulated in fp32 either way; one bf16 rounding of the result.
    torch.testing.assert_close(logits.float(), expected, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("n", [1, 8, weight_gemv.MAX_ROWS])
def test_kernel_multiplies_decode_rows_without_native_bf16(head, kernel_calls, monkeypatch, n):
    """Where the CPU lacks native bf16, vLLM's head product is aten's, which widens the
    whole weight per call: decode-sized products take the kernel."""
    monkeypatch.setattr(weight_gemv, "native_bf16", lambda: False)
    method, layer = head
    x = rows(n)
    logits = method.apply(layer, x)
    assert kernel_calls == [n]
    assert torch.equal(logits, weight_gemv.product(x, layer.weight, None, weight_gemv.BF16))
    close_to_fp32(logits, x, layer.weight)


def test_larger_batches_multiply_widened_tiles_without_native_bf16(head, kernel_calls, monkeypatch):
    """Past the kernel's rows, the head is multiplied in fp32 tiles (aten's bf16 product
    would widen the whole weight per call); the same logits as the fp32 product."""
    monkeypatch.setattr(weight_gemv, "native_bf16", lambda: False)
    monkeypatch.setattr(model, "HEAD_TILE_ROWS", 1000)  # tiles, and a partial last one
    vllms = []
    monkeypatch.setattr(
        UnquantizedEmbeddingMethod, "apply", lambda *args, **kwargs: vllms.append(args)
    )
    method, layer = head
    x = rows(weight_gemv.MAX_ROWS + 1)
    logits = method.apply(layer, x)
    assert kernel_calls == [] and vllms == []
    close_to_fp32(logits, x, layer.weight)


@pytest.mark.parametrize("n", [1, weight_gemv.MAX_ROWS + 1])
def test_native_bf16_keeps_vllms_product_for_a_small_head(head, kernel_calls, monkeypatch, n):
    """With native bf16, vLLM's packed product of a head small enough to keep twice wins."""
    monkeypatch.setattr(weight_gemv, "native_bf16", lambda: True)
    vllms = []
    apply = UnquantizedEmbeddingMethod.apply

    def counted(self, layer, x, bias=None):
        vllms.append(x.shape[0])
        return apply(self, layer, x, bias)

    monkeypatch.setattr(UnquantizedEmbeddingMethod, "apply", counted)
    method, layer = head
    x = rows(n)
    close_to_fp32(method.apply(layer, x), x, layer.weight)
    assert kernel_calls == [] and vllms == [n]
