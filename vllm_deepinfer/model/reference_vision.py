"""The release's vision path in plain PyTorch, written to be read: the oracle that
upstream vLLM's ViT and aligner (which the served model reuses) are tested against.

Per image: patches -> linear patch embedding -> blocks of {RMSNorm, bidirectional
attention with 2D RoPE (row index on the first half of each rotated pair's frequencies,
column index on the second), RMSNorm, SwiGLU} -> RMSNorm -> r x r spatial merge
(zero-padded at the edges, channel-major within a cell) -> Linear-GELU-Linear into the
text width -> the span: start vector, each row of cells followed by the newline vector,
end vector.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_deepinfer.model.deepseek_v41.ops import rms_norm

VISION_NORM_EPS = 1e-6


def vision_rope(rows: int, cols: int, rotated_half: int, theta: float):
    """cos, sin [rows*cols, 1, rotated_half]: a patch at (i, j) turns by i times the first
    half of the frequencies and by j times the second."""
    inv_freq = theta ** -(torch.arange(0, rotated_half, 2, dtype=torch.float64) / rotated_half)
    i, j = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    angles = torch.cat([i.reshape(-1, 1) * inv_freq, j.reshape(-1, 1) * inv_freq], dim=-1)
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on halves: (a, b) -> (a cos - b sin, b cos + a sin)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def vit(w: dict[str, torch.Tensor], v: dict, patches: torch.Tensor, rows: int, cols: int
        ) -> torch.Tensor:
    """[rows*cols, vision_dim] features of one image's patches [rows*cols, 3, p, p]."""
    n, dim, heads = patches.shape[0], v["vision_dim"], v["vision_n_heads"]
    head_dim = dim // heads
    x = patches.flatten(1) @ w["vision.patch_embed.proj.weight"].T \
        + w["vision.patch_embed.proj.bias"]
    cos, sin = vision_rope(rows, cols, head_dim // 2, v["vision_rope_theta"])
    for block in range(v["vision_n_layers"]):
        p = f"vision.blocks.{block}."
        y = rms_norm(x, w[p + "norm1.weight"], VISION_NORM_EPS)
        q, k, values = (y @ w[p + "attn.wqkv.weight"].T + w[p + "attn.wqkv.bias"]) \
            .view(n, 3, heads, head_dim).unbind(1)
        q, k = rotate(q, cos.to(q.dtype), sin.to(q.dtype)), rotate(k, cos.to(k.dtype),
                                                                    sin.to(k.dtype))
        weights = torch.einsum("qhd,khd->hqk", q, k).mul(head_dim ** -0.5).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", weights, values).reshape(n, dim)
        x = x + out @ w[p + "attn.wo.weight"].T + w[p + "attn.wo.bias"]
        y = rms_norm(x, w[p + "norm2.weight"], VISION_NORM_EPS)
        gate, up = (y @ w[p + "mlp.w1.weight"].T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ w[p + "mlp.w2.weight"].T
    return rms_norm(x, w["vision.norm.weight"], VISION_NORM_EPS)


def aligned_cells(w: dict[str, torch.Tensor], ratio: int, features: torch.Tensor, rows: int,
                  cols: int) -> torch.Tensor:
    """[ceil(rows/r) * ceil(cols/r), H]: each r x r cell of patch features (zeros past
    the edge), flattened channel-major, through the aligner, in reading order."""
    dim = features.shape[-1]
    grid = features.view(rows, cols, dim)
    grid = F.pad(grid, (0, 0, 0, -cols % ratio, 0, -rows % ratio))
    cell_rows, cell_cols = grid.shape[0] // ratio, grid.shape[1] // ratio
    cells = grid.view(cell_rows, ratio, cell_cols, ratio, dim).permute(0, 2, 4, 1, 3) \
        .reshape(cell_rows * cell_cols, dim * ratio * ratio)
    hidden = F.gelu(cells @ w["aligner.w1.weight"].T + w["aligner.w1.bias"])
    return hidden @ w["aligner.w2.weight"].T + w["aligner.w2.bias"]


def image_span(w: dict[str, torch.Tensor], cells: torch.Tensor, cell_rows: int,
               cell_cols: int) -> torch.Tensor:
    """[cell_rows * (cell_cols + 1) + 2, H]: start, rows each ended by a newline, end."""
    parts = [w["image_start"][None]]
    for row in cells.view(cell_rows, cell_cols, -1):
        parts += [row, w["image_newline"][None]]
    parts.append(w["image_end"][None])
    return torch.cat(parts).to(cells.dtype)
