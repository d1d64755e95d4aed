"""The lightning indexer's scores as a Triton kernel.

The indexer scores every compressed position for every query token, so at long context its
[T, G] score matrix is the hottest loop of prefill. Its torch twin
(``vllm_deepinfer.model.deepseek_v41.indexer.index_scores``) materialises a [T, nI, G]
intermediate; this kernel keeps a [BLOCK_T, BLOCK_G] fp32 accumulator in registers, loads
each key tile once and loops over the indexer heads:

    scores[t, g] = sum_h weights[t, h] * relu(q_idx[t, h, :] . keys[g, :])
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _index_scores_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    out_ptr,
    T,
    G,
    n_heads,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_wb,
    stride_wt,
    stride_wh,
    stride_kb,
    stride_kg,
    stride_kd,
    stride_ob,
    stride_ot,
    stride_og,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Axis 2 is the request: each scores its own queries against its own keys.
    batch = tl.program_id(2)
    q_ptr += batch * stride_qb
    w_ptr += batch * stride_wb
    k_ptr += batch * stride_kb
    out_ptr += batch * stride_ob
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    mask_t = offs_t < T
    mask_g = offs_g < G

    # Keys are shared by every head: load the tile once, already transposed to [D, BLOCK_G].
    k = tl.load(
        k_ptr + offs_d[:, None] * stride_kd + offs_g[None, :] * stride_kg,
        mask=mask_g[None, :],
        other=0.0,
    )
    # tl.full, not tl.zeros: tl.zeros is itself a @triton.jit helper, which the interpreter
    # cannot call once triton.language was imported outside interpret mode (vLLM does).
    acc = tl.full((BLOCK_T, BLOCK_G), 0.0, dtype=tl.float32)
    for h in range(n_heads):
        q = tl.load(
            q_ptr + offs_t[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
            mask=mask_t[:, None],
            other=0.0,
        )
        w = tl.load(w_ptr + offs_t * stride_wt + h * stride_wh, mask=mask_t, other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION)  # [BLOCK_T, BLOCK_G], fp32
        acc += w.to(tl.float32)[:, None] * tl.maximum(s, 0.0)

    tl.store(
        out_ptr + offs_t[:, None] * stride_ot + offs_g[None, :] * stride_og,
        acc,
        mask=mask_t[:, None] & mask_g[None, :],
    )


def index_scores(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    block_t: int = 32,
    block_g: int = 64,
) -> torch.Tensor:
    """q_idx [..., T, nI, dI], weights [..., T, nI], keys [..., G, dI] -> fp32 [..., T, G]
    (at most one leading request dimension); same math as the torch twin. Block sizes must
    be powers of two, at least 16 (tl.dot's minimum)."""
    batched = q_idx.dim() == 4
    if not batched:
        q_idx, weights, keys = q_idx[None], weights[None], keys[None]
    b, t, n_heads, d = q_idx.shape
    g = keys.shape[1]
    assert weights.shape == (b, t, n_heads) and keys.shape == (b, g, d), (weights.shape, keys.shape)
    assert d in (16, 32, 64, 128, 256), f"dI must be a power of two in [16, 256], got {d}"
    assert block_t >= 16 and block_g >= 16, "tl.dot needs blocks of at least 16"
    dtype = torch.promote_types(q_idx.dtype, keys.dtype)  # tl.dot wants one input dtype
    assert dtype in (torch.float16, torch.bfloat16, torch.float32), dtype
    q_idx, keys = q_idx.to(dtype), keys.to(dtype)
    out = torch.empty(b, t, g, dtype=torch.float32, device=q_idx.device)
    if b and t and g:
        grid = (triton.cdiv(t, block_t), triton.cdiv(g, block_g), b)
        _index_scores_kernel[grid](
            q_idx,
            weights,
            keys,
            out,
            t,
            g,
            n_heads,
            *q_idx.stride(),
            *weights.stride(),
            *keys.stride(),
            *out.stride(),
            D=d,
            BLOCK_T=block_t,
            BLOCK_G=block_g,
            # fp32 inputs would otherwise go through TF32 tensor cores (~1e-3 relative
            # error); half-precision inputs are exact in any mode.
            PRECISION="ieee" if dtype == torch.float32 else "tf32",
        )
    else:
        out.zero_()
    return out if batched else out[0]
