"""V4.1's one routing rule that transformers' V4 lacks: in the vision-language release,
image tokens select experts with `bias_vl` instead of `bias`. (sqrtsoftplus scores, the
bias steering selection only, renormalised x scaled weights are checked against
transformers in test_components_vs_transformers.py.)

Oracle: upstream's DeepSeek V4 router kernel `_dsv4_topk_kernel`
(vllm/model_executor/layers/fused_moe/router/dsv4_topk.py:40-114), Triton/CUDA only, so
emulated below from its source; the sentinel id comes from upstream's V4.1 MoE, which
passes image_sentinel_lo=IMAGE_SENTINEL_BASE_ID (vllm/models/deepseek_v41/nvidia/
model.py:125-151; common/mm_preprocess.py:51).
"""

from types import SimpleNamespace

import pytest
import torch

from helpers import upstream
from vllm_deepinfer.model.deepseek_v41.args import VISION_ROUTED_IDS
from vllm_deepinfer.model.deepseek_v41.moe import V41Router, route

pytestmark = pytest.mark.unit

EXPERTS, TOP_K, HIDDEN, SCALING = 32, 6, 16, 1.5


def _emulate_dsv4_topk(logits, bias, input_ids, bias_vl, sentinel_lo, top_k=TOP_K):
    """_dsv4_topk_kernel, one row per token: a token whose id is in
    [sentinel_lo, sentinel_lo + 5) uses bias_vl (:61-73); weights = sqrt(softplus) with
    the x > 20 shortcut (:83); top_k rounds of 'max of weights + bias, lowest expert id
    on ties' (:85-101); the chosen *unbiased* weights renormalised to sum
    routed_scaling_factor (:102-105)."""
    is_image = (input_ids >= sentinel_lo) & (input_ids < sentinel_lo + 5)
    row_bias = torch.where(is_image[:, None], bias_vl[None, :], bias[None, :])
    weights = torch.sqrt(torch.where(logits > 20, logits, torch.log1p(torch.exp(logits))))
    ids = torch.empty(logits.shape[0], top_k, dtype=torch.long)
    chosen_w = torch.empty(logits.shape[0], top_k, dtype=logits.dtype)
    for t in range(logits.shape[0]):
        current = (weights[t] + row_bias[t]).clone()
        for slot in range(top_k):
            best = int(torch.nonzero(current == current.max())[0])
            ids[t, slot], chosen_w[t, slot] = best, weights[t, best]
            current[best] = float("-inf")
    total = chosen_w.sum(-1, keepdim=True)
    return chosen_w * SCALING / torch.where(total > 0, total, torch.ones_like(total)), ids


@torch.no_grad()
def test_vision_language_routing_matches_upstream_router():
    """Tokens with ids just below, inside and just above the five image sentinels: the
    project's router (selection_bias over VISION_ROUTED_IDS, then route) picks upstream's
    experts in upstream's order with upstream's weights."""
    sentinel_lo = upstream(
        "vllm.models.deepseek_v41.common.mm_preprocess", "IMAGE_SENTINEL_BASE_ID"
    )
    g = torch.Generator().manual_seed(0)
    router = V41Router(SimpleNamespace(hidden_size=HIDDEN, vision_language=True), EXPERTS)
    router.bias.copy_(torch.randn(EXPERTS, generator=g))
    router.bias_vl.copy_(torch.randn(EXPERTS, generator=g) * 2)
    ids = torch.tensor(
        [
            5,
            sentinel_lo - 1,
            sentinel_lo,
            sentinel_lo + 1,
            sentinel_lo + 4,
            sentinel_lo + 5,
            100,
            sentinel_lo + 2,
        ]
    )
    logits = torch.randn(len(ids), EXPERTS, generator=g) * 3
    logits[0, :4] += 25  # the softplus shortcut above 20

    expected_w, expected_ids = _emulate_dsv4_topk(
        logits, router.bias, ids, router.bias_vl, sentinel_lo
    )

    vision_routed = (ids >= VISION_ROUTED_IDS.start) & (ids < VISION_ROUTED_IDS.stop)
    weights, chosen = route(logits, router.selection_bias(vision_routed), TOP_K, SCALING)
    _, text_ids = _emulate_dsv4_topk(logits, router.bias, ids, router.bias, sentinel_lo)
    assert not torch.equal(expected_ids, text_ids)  # bias_vl does change picks
    assert torch.equal(chosen, expected_ids)
    torch.testing.assert_close(weights, expected_w, atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_router_weight_is_held_in_fp32_under_a_bf16_model():
    """The logits are an fp32 product: the router keeps its weight in fp32 whatever the
    model dtype, and a release's bf16 values load into it exactly (nothing widens the
    weight again in a step)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        router = V41Router(SimpleNamespace(hidden_size=HIDDEN, vision_language=False), EXPERTS)
    finally:
        torch.set_default_dtype(previous)
    assert router.weight.dtype == torch.float32
    stored = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(1))
    stored = stored.to(torch.bfloat16)
    router.weight.copy_(stored)
    assert torch.equal(router.weight, stored.float())
