"""`rotate` against vLLM's DeepSeek V4 rotary it reads its angles from: the same values,
bit for bit, in place, with fewer traced nodes (rope.py)."""

from types import SimpleNamespace

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config

from vllm_deepinfer.model.deepseek_v41.rope import make_rope, rotate

pytestmark = pytest.mark.unit

ARGS = SimpleNamespace(
    head_dim=64,
    qk_rope_head_dim=16,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)


@pytest.mark.parametrize("ratio", [0, 4])  # plain RoPE (SWA-only layers), YaRN
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [None, 3])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotate_equals_vllm_forward_native(ratio, dtype, heads, inverse):
    with set_current_vllm_config(VllmConfig()):
        rope = make_rope(ARGS, ratio)
    generator = torch.Generator().manual_seed(ratio + 7 * (heads or 0) + int(inverse))
    shape = (11, ARGS.head_dim) if heads is None else (11, heads, ARGS.head_dim)
    x = torch.randn(shape, generator=generator).to(dtype)
    positions = torch.randint(0, ARGS.max_position_embeddings, (11,), generator=generator)
    rows = x if heads else x[:, None, :]
    expected, _ = rope.forward_native(positions, rows.clone(), None, inverse=inverse)
    rows_made = x.clone()
    got = rotate(rope, positions, rows_made, inverse=inverse)
    assert got is rows_made  # rotated in place
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got, expected.view_as(x))
    assert not torch.equal(got[..., -ARGS.qk_rope_head_dim :], x[..., -ARGS.qk_rope_head_dim :])
    assert torch.equal(got[..., : -ARGS.qk_rope_head_dim], x[..., : -ARGS.qk_rope_head_dim])
