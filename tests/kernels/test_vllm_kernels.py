"""vLLM's fused V4 CPU kernels that V4.1 calls (kernels/vllm_kernels.py) against their
torch twins on the same inputs: the hyper-connection post-mix (`hc_update`) and the
router's biased top-k (`route`); when each is chosen; and the tiny model's greedy tokens
in bf16 with them and without. Where this CPU's `_C` lacks an op (AVX2 machines load
`_C_AVX2`), the comparisons skip and the choice tests check that the plugin's path is
kept."""

import pytest
import torch

from helpers import close_llm, generate, make_llm, random_prompts, runner_of
from vllm_deepinfer.kernels import vllm_kernels
from vllm_deepinfer.model.deepseek_v41.hyper_connections import hc_update
from vllm_deepinfer.model.deepseek_v41.moe import route

HAS_HC_POST = vllm_kernels.loaded(vllm_kernels.HC_POST)
HAS_ROUTER = vllm_kernels.loaded(vllm_kernels.ROUTER_TOPK)
needs_hc_post = pytest.mark.skipif(
    not HAS_HC_POST, reason="vLLM's _C on this CPU has no hc_post_fused_cpu (AVX-512 + BF16 only)"
)
needs_router = pytest.mark.skipif(
    not HAS_ROUTER, reason="vLLM's _C on this CPU has no biased_topk_cpu (AVX-512 + BF16 only)"
)


@pytest.fixture(autouse=True)
def fresh_choice():
    vllm_kernels.enabled.cache_clear()
    vllm_kernels.router_fits.cache_clear()
    yield
    vllm_kernels.enabled.cache_clear()
    vllm_kernels.router_fits.cache_clear()


@pytest.mark.unit
@needs_hc_post
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("hidden", [256, 4096])
def test_hc_post_is_the_plugins_update(dtype, tokens, hidden):
    """Both accumulate in fp32 in the same order and round once: the same bits."""
    g = torch.Generator().manual_seed(tokens + hidden)
    copies = torch.randn(tokens, 4, hidden, generator=g).to(dtype)
    out = torch.randn(tokens, hidden, generator=g).to(dtype)
    post = torch.rand(tokens, 4, generator=g) * 2
    comb = torch.rand(tokens, 4, 4, generator=g).softmax(-1)
    got = vllm_kernels.hc_post(copies, comb, post, out)
    want = hc_update(copies, comb, post, out)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.unit
@needs_router
@pytest.mark.parametrize(("n_experts", "top_k"), [(384, 6), (256, 8), (128, 6), (64, 6)])
@pytest.mark.parametrize("tokens", [1, 33])
def test_router_is_the_plugins_route(n_experts, top_k, tokens):
    g = torch.Generator().manual_seed(n_experts + tokens)
    logits = torch.randn(tokens, n_experts, generator=g)
    bias = torch.randn(n_experts, generator=g) * 0.1
    assert vllm_kernels.router_fits(n_experts, top_k)
    weights, chosen = vllm_kernels.route(logits, bias, top_k, 1.5)
    want_weights, want_chosen = route(logits, bias, top_k, 1.5)
    assert chosen.dtype == want_chosen.dtype == torch.int64
    assert torch.equal(chosen, want_chosen)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-6)


@pytest.mark.unit
def test_the_plugins_path_is_kept_where_vllms_does_not_fit(monkeypatch):
    assert not vllm_kernels.hc_post_fits(torch.float32)  # the kernel refuses fp32
    assert not vllm_kernels.router_fits(8, 2)  # the tiny model's router: no such kernel
    assert vllm_kernels.hc_post_fits(torch.bfloat16) == HAS_HC_POST
    monkeypatch.setenv("DEEPINFER_VLLM_KERNELS", "plugin")
    vllm_kernels.enabled.cache_clear()
    vllm_kernels.router_fits.cache_clear()
    assert not vllm_kernels.hc_post_fits(torch.bfloat16)
    assert not vllm_kernels.router_fits(384, 6)


@pytest.mark.unit
def test_the_router_probe_runs_on_the_cpu_whatever_device_the_model_is_built_on():
    """vLLM builds some models on a meta device, where the op's fake kernel takes any
    shape: the probe must still refuse the tiny router and take V4.1-Flash's."""
    with torch.device("meta"):
        assert not vllm_kernels.router_fits(8, 2)
        assert vllm_kernels.router_fits(384, 6) == HAS_ROUTER


@pytest.mark.unit
def test_batch_invariant_mode_keeps_the_plugins_path():
    from vllm_deepinfer.kernels import paths

    model = paths.Model(torch.bfloat16, 384, 6, batch_invariant=True)
    chosen = paths.selected(model)
    for part in ("hyper_connection_post", "router_topk"):
        assert chosen[part][0] == paths.PLUGIN
        if HAS_HC_POST:
            assert "batch-invariant" in chosen[part][1]


@pytest.mark.engine
@needs_hc_post
def test_greedy_tokens_in_bf16_are_the_plugins_path(tiny_checkpoint, monkeypatch):
    """The tiny model in bf16 with vLLM's post-mix in every layer gives the plugin
    path's greedy tokens."""
    prompts = random_prompts([5, 40, 130, 23, 64, 9], seed=21)
    outputs = {}
    for choice in ("auto", "plugin"):
        monkeypatch.setenv("DEEPINFER_VLLM_KERNELS", choice)
        vllm_kernels.enabled.cache_clear()
        llm = make_llm(tiny_checkpoint, dtype="bfloat16")
        try:
            layers = runner_of(llm).model.model.layers
            expected = vllm_kernels.hc_post if choice == "auto" else hc_update
            assert all(layer.update is expected for layer in layers)
            outputs[choice] = [
                list(o.outputs[0].token_ids)
                for o in generate(llm, prompts, 16, prompt_logprobs=False)
            ]
        finally:
            close_llm(llm)
    assert outputs["auto"] == outputs["plugin"]
