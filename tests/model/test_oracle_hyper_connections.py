"""V4.1's hyper-connections against upstream vLLM's torch-native mHC helpers, and V4.1's
delayed pre-mix wiring against upstream's V4.1 layer loop.

Oracles (imported from the installed vLLM, vllm/model_executor/kernels/mhc/torch.py):
* `mhc_pre_delayed_torch` (:6-45) -- V4.1's boundary: (post, comb, layer input collapsed
  with the *carried* pre-mix (copy 0 when none), this boundary's pre-mix);
* `mhc_pre_torch` (:48-132) -- V4's boundary (collapses with its own pre), bf16 only;
* `mhc_post_torch` (:135-147) -- the residual update.
The V4.1 layer loop lives in vllm/models/deepseek_v41/nvidia/model.py
(DeepseekV4DecoderLayer.forward :455-625, the model's final collapse :1062-1071 and
_collapse :1138-1159) and runs on TileLang/Triton kernels; `upstream_v41_forward` below
re-states its order of operations with the torch helpers above (the same decomposition
upstream's own MHCPreDelayedOp.forward_native uses, vllm/model_executor/layers/mhc.py:516).
transformers' V4 mHC is already compared in tests/test_components_vs_transformers.py.
"""

import pytest
import torch
import torch.nn.functional as F

from helpers import upstream
from vllm_deepinfer.model.deepseek_v41.decoder import decoder_step
from vllm_deepinfer.model.deepseek_v41.hyper_connections import (
    HC_POST_ALPHA,
    hc_collapse,
    hc_mixes,
    hc_update,
)
from vllm_deepinfer.model.deepseek_v41.ops import rms_norm

pytestmark = pytest.mark.unit

# Upstream computes in fp32; so do we here. Observed differences <= 5e-7.
FP32_TOL = dict(atol=1e-5, rtol=1e-5)

T, HC, HIDDEN = 10, 4, 32
MIXES = (2 + HC) * HC
HC_EPS, RMS_EPS, SINKHORN_ITERS = 1e-6, 1e-6, 20


MHC = "vllm.model_executor.kernels.mhc.torch"


def random_boundary(g: torch.Generator):
    """fn, base, scale that keep the mix logits O(1) (no saturated sigmoid/softmax) and
    make comb clearly asymmetric."""
    fn = torch.randn(MIXES, HC * HIDDEN, generator=g) / (HC * HIDDEN) ** 0.5
    base = torch.randn(MIXES, generator=g) * 0.5
    scale = torch.rand(3, generator=g) * 1.5 + 0.5
    return fn, base, scale


def ours_mixes(copies, fn, base, scale):
    return hc_mixes(copies, fn, base, scale, HC_EPS, RMS_EPS, SINKHORN_ITERS)


def theirs_pre_delayed(copies, fn, base, scale, pre_mix=None, x=None):
    pre_delayed = upstream(MHC, "mhc_pre_delayed_torch")
    post, comb, layer_input, next_pre = pre_delayed(
        copies,
        fn,
        scale,
        base,
        RMS_EPS,
        HC_EPS,
        HC_EPS,
        HC_POST_ALPHA,
        SINKHORN_ITERS,
        pre_mix=pre_mix,
        x=x,
    )
    return post[..., 0], comb, layer_input, next_pre


# --- the boundary ops ------------------------------------------------------------------
@torch.no_grad()
def test_hc_mixes_and_collapse_match_upstream_pre_delayed():
    """pre/post/comb of one boundary, and the collapse with a carried pre-mix (and with
    none: copy 0), equal upstream's V4.1 delayed pre."""
    g = torch.Generator().manual_seed(0)
    fn, base, scale = random_boundary(g)
    copies = torch.randn(T, HC, HIDDEN, generator=g) * 3
    carried = torch.rand(T, HC, generator=g) + 0.1

    pre, post, comb = ours_mixes(copies, fn, base, scale)
    exp_post, exp_comb, exp_input, exp_pre = theirs_pre_delayed(
        copies, fn, base, scale, pre_mix=carried
    )
    _, _, exp_first_input, _ = theirs_pre_delayed(copies, fn, base, scale)

    assert (comb - comb.transpose(-1, -2)).abs().max() > 1e-2
    torch.testing.assert_close(pre, exp_pre, **FP32_TOL)
    torch.testing.assert_close(post, exp_post, **FP32_TOL)
    torch.testing.assert_close(comb, exp_comb, **FP32_TOL)
    torch.testing.assert_close(hc_collapse(copies, carried), exp_input, **FP32_TOL)
    torch.testing.assert_close(hc_collapse(copies, None), exp_first_input, rtol=0, atol=0)


@torch.no_grad()
def test_hc_mixes_match_upstream_pre_on_bf16_copies():
    """V4's non-delayed pre (bf16 copies only): post and comb agree; collapsing with our
    own pre gives upstream's bf16 layer input to within one bf16 rounding."""
    mhc_pre = upstream(MHC, "mhc_pre_torch")
    g = torch.Generator().manual_seed(1)
    fn, base, scale = random_boundary(g)
    copies = (torch.randn(T, HC, HIDDEN, generator=g) * 3).bfloat16()

    exp_post, exp_comb, exp_input = mhc_pre(
        copies, fn, scale, base, RMS_EPS, HC_EPS, HC_EPS, HC_POST_ALPHA, SINKHORN_ITERS
    )
    pre, post, comb = ours_mixes(copies, fn, base, scale)

    torch.testing.assert_close(post, exp_post[..., 0], **FP32_TOL)
    torch.testing.assert_close(comb, exp_comb, **FP32_TOL)
    torch.testing.assert_close(hc_collapse(copies, pre), exp_input)  # bf16 tolerances


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_hc_update_matches_upstream_post(dtype):
    """copies'[j] = sum_i comb[i, j] copies[i] + post[j] out (comb's first index is the
    source copy: a transposed comb would fail, comb being asymmetric)."""
    mhc_post = upstream(MHC, "mhc_post_torch")
    g = torch.Generator().manual_seed(2)
    fn, base, scale = random_boundary(g)
    copies = (torch.randn(T, HC, HIDDEN, generator=g) * 3).to(dtype)
    out = torch.randn(T, HIDDEN, generator=g).to(dtype)
    _, post, comb = ours_mixes(copies, fn, base, scale)

    expected = mhc_post(out, copies, post[..., None], comb)
    ours = hc_update(copies, comb, post, out)
    assert ours.dtype == expected.dtype == dtype
    torch.testing.assert_close(ours, expected, **(FP32_TOL if dtype == torch.float32 else {}))


# --- the V4.1 delayed pre-mix wiring ---------------------------------------------------
class ToyModel:
    """Three layers of fixed stand-ins: attention and FFN are fixed nonlinear maps, the
    norms weighted RMSNorms, layer 1 carries an 'Engram' (a fixed map of the copies)."""

    def __init__(self, seed: int, layers: int = 3, engram_layers=(1,)):
        g = torch.Generator().manual_seed(seed)
        self.boundaries = [{b: random_boundary(g) for b in ("attn", "ffn")} for _ in range(layers)]
        w = lambda: torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5  # noqa: E731
        self.attn_w = [w() for _ in range(layers)]
        self.ffn_w = [w() for _ in range(layers)]
        self.attn_norm = [torch.rand(HIDDEN, generator=g) + 0.5 for _ in range(layers)]
        self.ffn_norm = [torch.rand(HIDDEN, generator=g) + 0.5 for _ in range(layers)]
        self.final_norm = torch.rand(HIDDEN, generator=g) + 0.5
        self.engram_w = {i: w() * 0.3 for i in engram_layers}
        self.embedding = torch.randn(T, HIDDEN, generator=g)

    def attention(self, i, x):
        return torch.tanh(x @ self.attn_w[i].T)

    def ffn(self, i, x):
        return torch.sin(x @ self.ffn_w[i].T) * 2

    def engram(self, i, copies):
        return copies + torch.tanh(copies @ self.engram_w[i].T)


def project_forward(m: ToyModel) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The project's layer loop: decoder_step per layer, then the final collapse with the
    last layer's `pre` and the final norm (V41Model._forward's last lines)."""
    copies = m.embedding[:, None, :].expand(-1, HC, -1).contiguous()
    pre, per_layer = None, []
    for i, boundary in enumerate(m.boundaries):
        copies, pre = decoder_step(
            copies,
            pre,
            mixes=lambda c, b, boundary=boundary: ours_mixes(c, *boundary[b]),
            engram=(lambda c, i=i: m.engram(i, c)) if i in m.engram_w else None,
            attention=lambda x, i=i: m.attention(i, x),
            attn_norm=lambda x, i=i: rms_norm(x, m.attn_norm[i], RMS_EPS),
            ffn=lambda x, i=i: m.ffn(i, x),
            ffn_norm=lambda x, i=i: rms_norm(x, m.ffn_norm[i], RMS_EPS),
        )
        per_layer.append(copies)
    return rms_norm(hc_collapse(copies, pre), m.final_norm, RMS_EPS), per_layer


def upstream_v41_forward(m: ToyModel) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Upstream V4.1's order of operations (nvidia/model.py), each fused kernel replaced by
    the torch helpers it computes; norms by torch's own F.rms_norm.

    * first layer (:494-514): the embedding broadcast to hc copies, its pre projected from
      the embedding itself with the hc blocks of fn summed (`hc_attn_fn_broadcast`,
      built at :1413-1426), pre_mix=None so the attention input is copy 0;
    * later layers (:562-586, `mhc_shifted_post_pre` = post then delayed pre,
      vllm/models/deepseek_v41/nvidia/ops/mhc.py:191-322): the previous FFN's post, then
      the attention boundary's mixes with pre_mix = the previous layer's FFN pre;
    * an Engram layer (:531-563): the previous post, then Engram on the copies, then the
      attention boundary with the carried pre_mix;
    * the FFN boundary (:597-625): post of attention, FFN mixes with pre_mix = this
      layer's attention pre; the layer returns the FFN pre as the next carried pre_mix;
    * after the last layer: its FFN post (_collapse :1138-1159), then hc_collapse_triton
      with the last FFN pre (:1062-1071; kernels/mhc/triton.py:65-105 is sum_j pre_j
      copies_j), then the final norm.
    """
    mhc_post = upstream(MHC, "mhc_post_torch")
    x = m.embedding
    residual = post = comb = pre_mix = None
    per_layer = []
    for i, boundary in enumerate(m.boundaries):
        fn, base, scale = boundary["attn"]
        if residual is None:
            residual = x[:, None, :].expand(-1, HC, -1).contiguous()
            fn_broadcast = fn.view(MIXES, HC, HIDDEN).sum(1)
            post, comb, layer_input, attn_pre = theirs_pre_delayed(
                residual, fn_broadcast, base, scale, x=x
            )
        else:
            residual = mhc_post(x, residual, post[..., None], comb)
            per_layer.append(residual)
            if i in m.engram_w:
                residual = m.engram(i, residual)
            post, comb, layer_input, attn_pre = theirs_pre_delayed(
                residual, fn, base, scale, pre_mix=pre_mix
            )
        x = m.attention(i, F.rms_norm(layer_input, (HIDDEN,), m.attn_norm[i], RMS_EPS))
        residual = mhc_post(x, residual, post[..., None], comb)
        post, comb, layer_input, pre_mix = theirs_pre_delayed(
            residual, *boundary["ffn"], pre_mix=attn_pre
        )
        x = m.ffn(i, F.rms_norm(layer_input, (HIDDEN,), m.ffn_norm[i], RMS_EPS))
    residual = mhc_post(x, residual, post[..., None], comb)
    per_layer.append(residual)
    collapsed = (pre_mix[:, :, None] * residual).sum(1)
    return F.rms_norm(collapsed, (HIDDEN,), m.final_norm, RMS_EPS), per_layer


def v4_schedule_forward(m: ToyModel) -> torch.Tensor:
    """The same toy with V4's schedule (each boundary collapses with its own pre): the
    wiring test must be able to tell the two apart."""
    copies = m.embedding[:, None, :].expand(-1, HC, -1).contiguous()
    pre = None
    for i, boundary in enumerate(m.boundaries):
        if i in m.engram_w:
            copies = m.engram(i, copies)
        pre, post, comb = ours_mixes(copies, *boundary["attn"])
        out = m.attention(i, rms_norm(hc_collapse(copies, pre), m.attn_norm[i], RMS_EPS))
        copies = hc_update(copies, comb, post, out)
        pre, post, comb = ours_mixes(copies, *boundary["ffn"])
        out = m.ffn(i, rms_norm(hc_collapse(copies, pre), m.ffn_norm[i], RMS_EPS))
        copies = hc_update(copies, comb, post, out)
    return rms_norm(hc_collapse(copies, pre), m.final_norm, RMS_EPS)


@pytest.mark.parametrize("engram_layers", [(1,), ()], ids=["engram-on-layer-1", "no-engram"])
@torch.no_grad()
def test_delayed_pre_wiring_matches_upstream_v41_layer_loop(engram_layers):
    """Three toy layers: the copies after every layer and the final hidden state of the
    project's decoder_step loop equal upstream V4.1's; V4's own-pre schedule differs."""
    m = ToyModel(seed=3, engram_layers=engram_layers)

    hidden, per_layer = project_forward(m)
    exp_hidden, exp_per_layer = upstream_v41_forward(m)

    for i, (ours, theirs) in enumerate(zip(per_layer, exp_per_layer, strict=True)):
        torch.testing.assert_close(ours, theirs, **FP32_TOL, msg=lambda s, i=i: f"layer {i}: {s}")
    torch.testing.assert_close(hidden, exp_hidden, **FP32_TOL)
    assert (v4_schedule_forward(m) - exp_hidden).abs().max() > 1e-2
