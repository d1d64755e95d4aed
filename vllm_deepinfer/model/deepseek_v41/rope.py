"""V4.1's rotary embedding: interleaved (GPT-J) rotation of the last qk_rope_head_dim dims,
plain RoPE on SWA-only layers and YaRN on compressed ones, and its inverse on the
attention output. `apply_rope` is the plain-torch math; `make_rope` builds vLLM's
DeepSeek V4 rotary with the same parameters for the paged model, and `rotate` applies its
cached angles with the same rotation (kernels/rope.py)."""

from __future__ import annotations

import math

import torch
from vllm.model_executor.layers.rotary_embedding import get_rope

from vllm_deepinfer.kernels import rope as rope_kernel
from vllm_deepinfer.kernels.rope import rotate_pairs
from vllm_deepinfer.model.deepseek_v41.layer_ops import register_writer


def rope_inv_freq(rope_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Per-pair inverse frequencies; YaRN's ramp between original and stretched ones."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim
    extrapolated = theta**-exponents
    if not scaling:
        return extrapolated.float()
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction_dim(scaling.get("beta_slow", 1))), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return (extrapolated / factor * ramp + extrapolated * (1 - ramp)).float()


def layer_rope_scaling(rope_scaling: dict, ratio: int) -> dict | None:
    """SWA-only layers use plain RoPE; compressed layers use the config's YaRN."""
    if ratio == 0:
        return None
    scaling = rope_scaling
    if isinstance(scaling.get("main"), dict) and isinstance(scaling.get("compress"), dict):
        scaling = scaling["compress"]
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind == "default" else scaling


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Interleaved (GPT-J) rotation of the last 2*len(inv_freq) dims. x: [T, ..., D]."""
    rope_dim = 2 * inv_freq.numel()
    precision = torch.float64 if x.dtype == torch.float64 else torch.float32
    angles = positions.to(precision)[:, None] * inv_freq[None, :].to(precision)
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [rope_dim // 2]
    sin = angles.sin().view(shape)
    return rotate_pairs(x, angles.cos().view(shape), -sin if inverse else sin)


def make_rope(a, ratio: int):
    """vLLM's DeepSeek V4 rotary for a layer of this compress ratio (no mscale)."""
    scaling = layer_rope_scaling(a.rope_scaling, ratio)
    params = {
        "rope_type": "deepseek_yarn",
        "mscale": 0,
        "mscale_all_dim": 0,
        "is_deepseek_v4": True,
        "rope_dim": a.qk_rope_head_dim,
        "rope_theta": a.compress_rope_theta if ratio else a.rope_theta,
    }
    if scaling is None:
        params.update(factor=1.0, original_max_position_embeddings=a.max_position_embeddings)
    else:
        params.update(
            factor=scaling["factor"],
            beta_fast=scaling.get("beta_fast", 32),
            beta_slow=scaling.get("beta_slow", 1),
            original_max_position_embeddings=scaling["original_max_position_embeddings"],
        )
    return get_rope(
        a.head_dim,
        max_position=a.max_position_embeddings,
        rope_parameters=params,
        is_neox_style=False,
        dtype=torch.float32,
    )


rope_rotate = register_writer("rope_rotate", rope_kernel.rotate_, ["x"])


def rotate(rope, positions: torch.Tensor, x: torch.Tensor, inverse: bool = False):
    """Rotates x [T, D] or [T, heads, D] in place at its own positions with a `make_rope`
    rotary's cos/sin cache and returns it: the same values as its `forward_native`,
    through one registered op (kernels/rope.py: the C kernel on the CPU, else the torch
    twin). Callers pass rows they just made."""
    rope_rotate(x, rope.cos_sin_cache, positions, inverse)
    return x
