"""Triton kernels against their torch twins in the model package, on the CPU.

Triton has no CPU backend; its interpreter runs a kernel's program instances one by one
with numpy instead. It is slow, so the shapes are small, but they are ragged on purpose
(not multiples of the block sizes) so that the masks are exercised."""

import importlib

import pytest
import torch

from vllm_deepinfer.model.deepseek_v41.indexer import index_scores

ATOL, RTOL = 1e-4, 1e-4


@pytest.fixture
def indexer_scores(monkeypatch):
    """The kernel module, used with TRITON_INTERPRET=1: Triton reads it when a kernel is
    decorated (compiled for a GPU or interpreted with numpy; without a GPU only the
    interpreter runs) and again when one is launched. monkeypatch restores the variable
    after each test, so vLLM elsewhere in the session sees the machine as it is."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return importlib.import_module("vllm_deepinfer.kernels.indexer_scores")


def indexer_inputs(t, g, n_heads, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, n_heads, d, generator=gen)
    q[:, 1] = -q[:, 0]  # head 1 = -head 0: every (t, g) has a negative dot product
    weights = torch.randn(t, n_heads, generator=gen)
    keys = torch.randn(g, d, generator=gen)
    return q, weights, keys


@pytest.mark.unit
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n_heads", [2, 4])
@pytest.mark.parametrize("g", [1, 17, 64])
@pytest.mark.parametrize("t", [1, 5, 37])
def test_index_scores_matches_reference(indexer_scores, t, g, n_heads, d):
    q, weights, keys = indexer_inputs(t, g, n_heads, d, seed=t * 1000 + g * 10 + n_heads)
    expected = index_scores(q, weights, keys)
    # Every case needs the ReLU: without it the result differs (head 1 cancels head 0).
    no_relu = torch.einsum("thd,gd,th->tg", q, keys, weights)
    assert not torch.allclose(no_relu, expected, atol=ATOL, rtol=RTOL)
    assert expected.abs().max() > 100 * ATOL  # a kernel writing zeros must fail

    got = indexer_scores.index_scores(q, weights, keys)
    assert got.dtype == torch.float32 and got.shape == (t, g)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.unit
@pytest.mark.parametrize("block_t,block_g", [(16, 16), (16, 32)])
def test_index_scores_across_tiles(indexer_scores, block_t, block_g):
    """Several tiles in both T and G, the last of each ragged; non-contiguous q_idx."""
    q, weights, keys = indexer_inputs(37, 70, 4, 64, seed=7)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # strides (d, T*d, 1)
    expected = index_scores(q, weights, keys)
    got = indexer_scores.index_scores(q, weights, keys, block_t=block_t, block_g=block_g)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.unit
def test_index_scores_half_precision_inputs(indexer_scores):
    """fp16 inputs: products are exact in fp32 and accumulation is fp32. (bf16 is what the
    model feeds, but the interpreter's tl.dot multiplies bf16 tiles as their raw uint16
    bits, so bf16 can only be checked on a GPU.)"""
    q, weights, keys = indexer_inputs(5, 17, 4, 128, seed=3)
    q, weights, keys = q.half(), weights.half(), keys.half()
    expected = index_scores(q, weights, keys)
    got = indexer_scores.index_scores(q, weights, keys)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


@pytest.mark.unit
def test_index_scores_batched_over_requests(indexer_scores):
    """A leading request dimension: each request's queries meet only its own keys."""
    per_request = [indexer_inputs(5, 17, 2, 64, seed=s) for s in range(3)]
    q, weights, keys = (torch.stack(parts).half() for parts in zip(*per_request))
    expected = torch.stack([index_scores(*(t[i] for t in (q, weights, keys))) for i in range(3)])
    got = indexer_scores.index_scores(q, weights, keys)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


@pytest.fixture
def fixed_tile_matmul(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return importlib.import_module("vllm_deepinfer.kernels.fixed_tile_matmul")


@pytest.mark.unit
@pytest.mark.parametrize("m,k,n", [(1, 32, 16), (5, 70, 40), (37, 64, 130)])
def test_fixed_tile_linear_matches_its_torch_twin(fixed_tile_matmul, m, k, n):
    """Ragged in every dimension (masks), against batch_invariant.linear's torch path."""
    from vllm_deepinfer.determinism import batch_invariant

    gen = torch.Generator().manual_seed(m * 100 + k + n)
    x, weight = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    expected = batch_invariant.linear(x, weight)
    assert expected.abs().max() > 1.0
    got = fixed_tile_matmul.fixed_tile_linear(x, weight)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def numpy_matmul_keeps_row_positions() -> bool:
    """Whether numpy's matmul (the Triton interpreter's tl.dot) gives a row the same bits
    wherever it sits in a 16-row tile. OpenBLAS's Haswell kernel (OPENBLAS_CORETYPE=Haswell,
    set on some of the project's machines) does not: the micro-kernel's edge rows sum in
    another order."""
    import numpy as np

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((32, 64)).astype(np.float32)
    row = rng.standard_normal(32).astype(np.float32)
    outputs = []
    for position in range(16):
        tile = np.zeros((16, 32), np.float32)
        tile[position] = row
        outputs.append((tile @ weight)[position].tobytes())
    return len(set(outputs)) == 1


@pytest.mark.unit
def test_fixed_tile_linear_rows_do_not_depend_on_the_batch(fixed_tile_matmul):
    """A row's output is bit-identical alone, first or last of a ragged batch (where the
    interpreter's dot itself is: the kernel's structure is what is checked)."""
    if not numpy_matmul_keeps_row_positions():
        pytest.skip(
            "numpy's BLAS gives a row other bits at another position of a tile, so "
            "the interpreted kernel cannot show the property on this machine"
        )
    gen = torch.Generator().manual_seed(5)
    weight, row = torch.randn(40, 96, generator=gen), torch.randn(96, generator=gen)
    alone = fixed_tile_matmul.fixed_tile_linear(row[None], weight)[0]
    for m, position in ((7, 0), (7, 6), (33, 20)):
        batch = torch.randn(m, 96, generator=gen)
        batch[position] = row
        assert torch.equal(fixed_tile_matmul.fixed_tile_linear(batch, weight)[position], alone)
