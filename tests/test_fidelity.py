"""The plugin's V4.1 inside vLLM computes what the plain-PyTorch reference computes.

Prompts are longer than the sliding window (32) and than index top-k (16 compressed
positions), so windows, top-k selection and candidate-block masking all act; they run
together in one batch of mixed lengths under a 16-token prefill budget, so prefills are
chunked and share steps with decodes.
"""
import pytest
import torch
from conftest import close_llm, make_llm

from vllm_deepinfer.model.reference import ReferenceV41

LOGPROB_TOLERANCE = 2e-3  # fp32 paged engine vs fp64 dense reference
PROMPT_LENGTHS = (1, 7, 33, 50, 97, 120, 150)
NEW_TOKENS = 10


def random_prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 800, (n,), generator=g).tolist() for n in lengths]


def generate(llm, prompts, new_tokens=NEW_TOKENS, prompt_logprobs=True):
    """Greedy; prompt logprobs make vLLM recompute the prompt, so prefix-cache tests
    ask for sampled logprobs only."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=0,
                            prompt_logprobs=0 if prompt_logprobs else None, ignore_eos=True)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)


def assert_matches_reference(reference, prompt, output):
    """Greedy tokens identical; sampled and prompt logprobs within tolerance."""
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    logprobs = reference.logits(prompt + tokens[:-1]).log_softmax(-1)
    assert logprobs[len(prompt) - 1:].argmax(-1).tolist() == tokens
    for step, (token, entry) in enumerate(zip(tokens, completion.logprobs)):
        expected = logprobs[len(prompt) - 1 + step, token].item()
        assert entry[token].logprob == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
    for i, entry in enumerate((output.prompt_logprobs or [None])[1:], start=1):
        expected = logprobs[i - 1, prompt[i]].item()
        assert entry[prompt[i]].logprob == pytest.approx(expected, abs=LOGPROB_TOLERANCE)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return ReferenceV41(tiny_checkpoint)


@pytest.fixture(scope="module")
def chunked_llm(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint, max_num_batched_tokens=16)
    yield llm
    close_llm(llm)


def test_mixed_batch_with_chunked_prefill_matches_reference(chunked_llm, reference):
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    for prompt, output in zip(prompts, generate(chunked_llm, prompts)):
        assert_matches_reference(reference, prompt, output)


def test_prefix_cache_hits_match_reference(chunked_llm, reference):
    """Exact repeats, a shared 100-token prefix with a new tail, and a hit that ends
    mid-group of the ratio-2 compressor all reuse cached blocks and stay exact."""
    base = random_prompts((150,), seed=2)[0]
    tails = random_prompts((21, 6), seed=3)
    generate(chunked_llm, [base], prompt_logprobs=False)
    prompts = [base, base[:100] + tails[0], base[:67] + tails[1]]
    outputs = generate(chunked_llm, prompts, prompt_logprobs=False)
    assert all(o.num_cached_tokens >= 64 for o in outputs), [o.num_cached_tokens for o in outputs]
    for prompt, output in zip(prompts, outputs):
        assert_matches_reference(reference, prompt, output)


def test_preemption_recomputes_exactly(tiny_checkpoint, reference):
    """Four requests that fit when admitted but not once they have grown: the scheduler
    preempts some and recomputes them from scratch."""
    llm = make_llm(tiny_checkpoint, num_gpu_blocks_override=66, max_model_len=192,
                   enable_prefix_caching=False, disable_log_stats=False)
    try:
        prompts = random_prompts((12, 16, 20, 24), seed=4)
        outputs = generate(llm, prompts, new_tokens=150)
        preemptions = sum(m.value for m in llm.get_metrics()
                          if m.name == "vllm:num_preemptions")
    finally:
        close_llm(llm)
    assert preemptions > 0
    for prompt, output in zip(prompts, outputs):
        assert_matches_reference(reference, prompt, output)


def test_quantized_checkpoint_matches_its_reference(quantized_checkpoint):
    """MXFP8 linears and MXFP4 experts dequantized on load, same as the reference does."""
    llm = make_llm(quantized_checkpoint, max_num_batched_tokens=32)
    try:
        prompts = random_prompts((5, 45, 110), seed=5)
        outputs = generate(llm, prompts)
    finally:
        close_llm(llm)
    reference = ReferenceV41(quantized_checkpoint)
    for prompt, output in zip(prompts, outputs):
        assert_matches_reference(reference, prompt, output)
