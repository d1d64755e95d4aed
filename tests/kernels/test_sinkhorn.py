"""The hyper-connections' Sinkhorn normalisation (kernels/sinkhorn.py): the C kernel against
its torch twin, and the registered op the model calls."""

import pytest
import torch

from vllm_deepinfer.kernels import sinkhorn as kernel

pytestmark = pytest.mark.unit


def mixes(t: int, n: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, n, n, generator=g) * 3).softmax(-1) + 1e-6


@pytest.mark.parametrize("t", [1, 5, 200])  # 200: split across threads
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_the_kernel_equals_its_twin(t, iters):
    if kernel.library() is None:
        pytest.skip("no C compiler on this machine: the kernel is not built")
    comb = mixes(t)
    got = kernel.sinkhorn(comb, iters, 1e-6)
    expected = kernel.sinkhorn_torch(comb, iters, 1e-6)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert not torch.equal(got, comb)  # a new tensor; the input is left as it was
    assert torch.equal(comb, mixes(t))
    # Columns sum to one (less eps over a column's sum) after the last step.
    torch.testing.assert_close(got.sum(-2), torch.ones(t, 4), atol=1e-3, rtol=0)


@pytest.mark.parametrize(("t", "n"), [(9, 4), (37, 4), (20, 8), (12, 9)])
def test_a_matrix_does_not_depend_on_the_batch(t, n):
    """Alone, a matrix takes the scalar loop; in a batch, a lane of a block of 16 (up to
    8 x 8; wider ones stay scalar): the same bits."""
    comb = mixes(t, n, seed=1)
    together = kernel.sinkhorn(comb, 20, 1e-6)
    for k in range(t):
        assert torch.equal(kernel.sinkhorn(comb[k : k + 1], 20, 1e-6)[0], together[k])


def test_other_dtypes_take_the_twin():
    comb = mixes(3).double()
    assert torch.equal(kernel.sinkhorn(comb, 20, 1e-6), kernel.sinkhorn_torch(comb, 20, 1e-6))


def test_the_registered_op_traces_as_one_node():
    """vLLM's compiled graph keeps the loop as one opaque call, not 40 reductions."""
    from vllm_deepinfer.model.deepseek_v41.hyper_connections import hc_sinkhorn

    graph = torch.fx.experimental.proxy_tensor.make_fx(lambda c: hc_sinkhorn(c, 20, 1e-6))(mixes(2))
    calls = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert calls == [torch.ops.deepinfer.hc_sinkhorn.default]
