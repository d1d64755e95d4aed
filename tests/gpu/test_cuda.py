"""The same model on a CUDA GPU: the Triton kernel against its torch twin (compiled, not
interpreted; bf16 included), the batched step's parts with CUDA tensors against the CPU,
and the paged model inside vLLM against the dense reference. Skipped without CUDA;
tests/gpu/run.sh runs them on a GPU machine."""

import pytest
import torch

from fixtures.reference import ReferenceV41
from helpers import assert_matches_reference, close_llm, generate, make_llm, random_prompts
from vllm_deepinfer.model.deepseek_v41.indexer import _index_scores, index_scores
from vllm_deepinfer.model.deepseek_v41.moe import grouped_experts
from vllm_deepinfer.model.deepseek_v41.step import StepBatch

pytestmark = pytest.mark.gpu


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_scores_kernel_matches_its_torch_twin(dtype):
    q, weights, keys = (
        _randn(3, 300, 32, 128, seed=1).to(dtype),
        _randn(3, 300, 32, seed=2).to(dtype),
        _randn(3, 1000, 128, seed=3).to(dtype),
    )
    expected = index_scores(q, weights, keys)
    got = _index_scores(q.cuda(), weights.cuda(), keys.cuda()).cpu()
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


def test_grouped_experts_on_cuda_match_the_cpu():
    x, w13, w2 = _randn(40, 32, seed=4), _randn(16, 48, 32, seed=5), _randn(16, 32, 24, seed=6)
    chosen = _randn(40, 16, seed=7).topk(4, -1).indices
    weights = _randn(40, 4, seed=8).softmax(-1)
    expected = grouped_experts(x, weights, chosen, w13, w2, 7.0)
    got = grouped_experts(*(t.cuda() for t in (x, weights, chosen, w13, w2)), 7.0)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_step_batch_lives_on_the_inputs_device():
    from vllm_deepinfer.kv_cache.paged import PagedStepMetadata

    md = PagedStepMetadata(
        torch.zeros(6, dtype=torch.int64),
        torch.zeros(3, 2, dtype=torch.int64),
        16,
        1,
        [4, 9, 2],
        [0, 1, 5, 6],
        3,
        6,
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(3, dtype=torch.int64),
    )
    step = StepBatch.from_metadata(md, torch.device("cuda"))
    assert step.request_of_token.is_cuda and step.replay_start.is_cuda and step.kept_from.is_cuda
    assert all(t.is_cuda for g in step.groups for t in (g.requests, g.tokens, g.seq_lens))


def test_paged_model_on_the_gpu_matches_the_reference(tiny_checkpoint):
    """The fidelity check of tests/model/test_fidelity.py with vLLM on the GPU: mixed
    prompt lengths under a small prefill budget, so chunks and decodes share steps."""
    llm = make_llm(tiny_checkpoint, max_num_batched_tokens=16)
    try:
        reference = ReferenceV41(tiny_checkpoint)
        prompts = random_prompts((1, 7, 33, 50, 97, 120, 150), seed=1)
        for prompt, output in zip(prompts, generate(llm, prompts)):
            assert_matches_reference(reference, prompt, output)
    finally:
        close_llm(llm)


def test_a_layers_traced_parts_capture_and_replay_in_a_cuda_graph():
    """What vLLM's compiled graph runs between the layer ops (hyper-connection mixing with
    Sinkhorn, the collapse and norm, the router's scores and top-k, the update) has no
    host sync: it captures into a CUDA graph, and replays on new inputs written into the
    captured buffers give what the same code gives eagerly."""
    from vllm_deepinfer.model.deepseek_v41.hyper_connections import hc_collapse, hc_mixes, hc_update
    from vllm_deepinfer.model.deepseek_v41.moe import route
    from vllm_deepinfer.model.deepseek_v41.ops import rms_norm

    tokens, hc, hidden, experts = 24, 4, 64, 16
    fn, base = _randn(24, hc * hidden, seed=9).cuda(), _randn(24, seed=10).cuda()
    scale, gate = _randn(3, seed=11).cuda(), _randn(experts, hidden, seed=12).cuda()
    bias = _randn(experts, seed=13).cuda()

    def traced_part(copies):
        pre, post, comb = hc_mixes(copies, fn, base, scale, 1e-6, 1e-6, 20)
        x = rms_norm(hc_collapse(copies, pre), None, 1e-6)
        weights, chosen = route(x @ gate.T, bias, 4, 1.5)
        return hc_update(copies, comb, post, x), weights, chosen

    static = _randn(tokens, hc, hidden, seed=14).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        traced_part(static)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = traced_part(static)
    for seed in (15, 16):
        fresh = _randn(tokens, hc, hidden, seed=seed).cuda()
        static.copy_(fresh)
        graph.replay()
        for got, expected in zip(outputs, traced_part(fresh)):
            torch.testing.assert_close(got, expected)
