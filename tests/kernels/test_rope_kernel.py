"""V4.1's rotary embedding of each row's tail, in place (kernels/rope.py): the C kernel
against its torch twin, bit for bit, as the model calls it (vLLM's cos/sin cache, queries
[T, heads, D], latents [T, D], the inverse on the attention output)."""

import pytest
import torch

from vllm_deepinfer.kernels import rope

pytestmark = pytest.mark.unit


def built():
    library = rope.library()
    if library is None:
        pytest.skip("no C compiler on this machine: the kernel is not built")
    return library


def rotated(x: torch.Tensor, table, positions, inverse: bool = False) -> torch.Tensor:
    """`rope.rotate_` on a copy of x."""
    out = x.clone()
    rope.rotate_(out, table, positions, inverse)
    return out


def _cache(rows: int, rope_dim: int) -> torch.Tensor:
    """A cos/sin cache laid out as vLLM's rotary keeps it: cos | sin per position."""
    angles = torch.arange(rows, dtype=torch.float32)[:, None] * torch.logspace(0, -4, rope_dim // 2)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 512), (7, 4, 512), (3, 2, 128), (0, 4, 64)])
@pytest.mark.parametrize("inverse", [False, True])
def test_kernel_rotation_has_the_twins_bits(dtype, shape, inverse):
    built()
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    table = _cache(300, 64)
    positions = torch.randint(0, 300, shape[:1], generator=g)
    got = rotated(x, table, positions, inverse)
    expected = rope.rotate_torch(x, table, positions, inverse)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, expected)


def test_rotation_and_its_inverse_return_the_rows():
    built()
    x = torch.randn(6, 3, 256)
    table, positions = _cache(64, 64), torch.arange(6) * 9
    back = rotated(rotated(x, table, positions), table, positions, inverse=True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)
    assert torch.equal(back[..., :-64], x[..., :-64])


def test_a_position_outside_the_cache_is_refused():
    built()
    x, table = torch.randn(3, 128), _cache(16, 64)
    with pytest.raises(IndexError, match="position 16 lies outside the 16 cached"):
        rope.rotate_(x.clone(), table, torch.tensor([0, 16, 2]))
    with pytest.raises(ValueError, match="2 positions for 3 tokens"):
        rope.rotate_(x.clone(), table, torch.tensor([0, 1]))


def test_rows_that_are_not_contiguous_rotate_through_the_twin_in_place():
    built()
    table, positions = _cache(32, 64), torch.arange(5)
    x = torch.randn(4, 5, 128).transpose(0, 1)
    assert not rope.fits(x, table)
    expected = rope.rotate_torch(x, table, positions, False)
    rope.rotate_(x, table, positions)
    assert torch.equal(x, expected)


def test_rows_the_kernel_does_not_take_use_the_twin():
    """fp64 (the reference) and fp16 rows rotate through the torch twin."""
    table, positions = _cache(32, 64), torch.arange(4)
    for dtype in (torch.float64, torch.float16):
        x = torch.randn(4, 128).to(dtype)
        assert not rope.fits(x, table)
        expected = rope.rotate_torch(
            x, table.to(torch.float64) if dtype == torch.float64 else table, positions, False
        )
        got = rotated(x, table.to(torch.float64) if dtype == torch.float64 else table, positions)
        assert torch.equal(got, expected)
