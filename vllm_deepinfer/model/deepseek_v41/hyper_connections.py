"""Manifold-constrained hyper-connections (mHC): the residual stream is `hc_mult` copies,
and each sublayer boundary mixes them. From the flattened copies one projection gives
`pre` (how to collapse the copies into the sublayer's input), `post` (how much of the
sublayer's output each copy takes) and `comb` (a doubly-stochastic copy-to-copy mix made
by Sinkhorn normalisation).

V4.1 applies each boundary's `pre` one boundary later than it is computed: a sublayer's
input collapses the copies with the previous boundary's `pre` (copy 0 before the first).

The Sinkhorn loop runs as one registered op (`hc_sinkhorn`, kernels/sinkhorn.py), opaque
to vLLM's compiled graph: unrolled by Inductor it dominated the model's compile time."""

from __future__ import annotations

import torch

from vllm_deepinfer.determinism import batch_invariant
from vllm_deepinfer.kernels.sinkhorn import sinkhorn
from vllm_deepinfer.model.deepseek_v41.layer_ops import register_function
from vllm_deepinfer.model.deepseek_v41.ops import wide

HC_POST_ALPHA = 2.0


def _sinkhorn_fake(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return torch.empty_like(comb)


hc_sinkhorn = register_function("hc_sinkhorn", sinkhorn, _sinkhorn_fake)


def hc_mixes(
    copies: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    rms_eps: float,
    sinkhorn_iters: int,
):
    """One boundary's (pre [T, hc], post [T, hc], comb [T, hc, hc]) from copies [T, hc, H]."""
    t, hc, _ = copies.shape
    flat = wide(copies.reshape(t, -1))
    mixes = batch_invariant.project(flat, wide(fn)) * torch.rsqrt(
        flat.pow(2).mean(-1, keepdim=True) + rms_eps
    )
    pre = batch_invariant.pointwise(torch.sigmoid, mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = (
        batch_invariant.pointwise(
            torch.sigmoid, mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc]
        )
        * HC_POST_ALPHA
    )
    comb = (mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(t, hc, hc)
    comb = hc_sinkhorn(comb.softmax(-1) + hc_eps, sinkhorn_iters, hc_eps)
    return pre, post, comb


def hc_update(
    copies: torch.Tensor, comb: torch.Tensor, post: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """copies'[j] = post[j] * out + sum_i comb[i, j] * copies[i], in fp32, rounded once.
    The sum runs in that order, copy by copy, as vLLM's fused post-mix
    (kernels/vllm_kernels.py) runs it, so the two give the same bits and the same tokens
    in bf16."""
    if batch_invariant.enabled():
        mixed = batch_invariant.weighted_sum(comb.transpose(1, 2), wide(copies)[:, None])
        return (mixed + post[:, :, None] * wide(out)[:, None, :]).to(copies.dtype)
    mixed = post[:, :, None] * wide(out)[:, None, :]
    for i in range(copies.shape[1]):
        mixed = torch.addcmul(mixed, comb[:, i, :, None], wide(copies[:, i])[:, None, :])
    return mixed.to(copies.dtype)


def hc_collapse(copies: torch.Tensor, pre: torch.Tensor | None) -> torch.Tensor:
    """Sublayer input: the pre-weighted sum of copies (copy 0 before any pre exists). As
    bmm, not einsum: the einsum traces into twice the compiled graph's nodes."""
    if pre is None:
        return copies[:, 0]
    if batch_invariant.enabled():
        return batch_invariant.weighted_sum(pre, wide(copies)).to(copies.dtype)
    return torch.bmm(pre[:, None, :], wide(copies))[:, 0].to(copies.dtype)
