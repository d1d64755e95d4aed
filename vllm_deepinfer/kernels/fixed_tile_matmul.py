"""A linear layer (x @ weight.T) with one fixed tiling, for batch-invariant inference on
GPUs.

Every program computes one [BLOCK_M, BLOCK_N] output tile with a single sequential loop
over K in BLOCK_K steps: no split-K, no choice that follows the shapes, so an output
element's reduction order depends on K alone, never on how many rows share the call or
where its row sits. Its torch twin is the CPU path of
``vllm_deepinfer.determinism.batch_invariant.linear`` (mm on fixed tiles of rows).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _fixed_tile_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # tl.full, not tl.zeros (see indexer_scores.py: the interpreter and vLLM's import).
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=(offs_m[:, None] < M) & (offs_k[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
            mask=(offs_k[:, None] < K) & (offs_n[None, :] < N),
            other=0.0,
        )
        acc += tl.dot(x, w, input_precision=PRECISION)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


def fixed_tile_linear(
    x: torch.Tensor, weight: torch.Tensor, block_m: int = 16, block_n: int = 64, block_k: int = 32
) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T -> [..., N] in x's dtype (fp32 accumulation). Blocks
    are powers of two, at least 16 (tl.dot's minimum)."""
    assert block_m >= 16 and block_n >= 16 and block_k >= 16, "tl.dot needs blocks >= 16"
    rows = x.reshape(-1, x.shape[-1])
    weight = weight.to(rows.dtype)
    m, k = rows.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, (weight.shape, rows.shape)
    out = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
    if m and n:
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _fixed_tile_matmul_kernel[grid](
            rows,
            weight,
            out,
            m,
            n,
            k,
            *rows.stride(),
            *weight.stride(),
            *out.stride(),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            PRECISION="ieee" if rows.dtype == torch.float32 else "tf32",
        )
    return out.reshape(*x.shape[:-1], n)
