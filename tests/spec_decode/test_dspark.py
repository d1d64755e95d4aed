"""DSpark on the engine: the draft stages against the reference, lossless greedy decoding
through vLLM's verification (method dspark and custom_class, fixed and variable length,
chunked prefill, mixed batches, a prefix-cache hit with bounded replay), and the counters.
The tiny checkpoint's random weights accept almost nothing; tests/spec_decode on the
trained pair and benchmarks/dspark.py measure acceptance."""

import pytest

from helpers import (
    assert_drafts_match_the_reference,
    close_llm,
    generate,
    make_llm,
    random_prompts,
    runner_of,
)
from vllm_deepinfer import envs
from vllm_deepinfer.model.deepseek_v41.registration import DSPARK_PROPOSER

pytestmark = pytest.mark.engine

DSPARK = {"method": "dspark", "num_speculative_tokens": 5}
CUSTOM = {"method": "custom_class", "model": DSPARK_PROPOSER, "num_speculative_tokens": 5}
# Lengths cut by the 64-token chunk budget; the last prompt is reused below for a hit.
PROMPTS = random_prompts([40, 70, 23, 300], seed=3)
NEW_TOKENS = 14


def run(llm):
    """Greedy outputs of PROMPTS, then of the long prompt again (a prefix-cache hit,
    recomputed by bounded replay) beside a fresh one."""
    first = generate(llm, PROMPTS, NEW_TOKENS, prompt_logprobs=False)
    again = generate(
        llm, [PROMPTS[3], random_prompts([50], seed=4)[0]], NEW_TOKENS, prompt_logprobs=False
    )
    return [list(o.outputs[0].token_ids) for o in first + again]


def sample_seeded(llm):
    """Seeded sampled outputs of two prompts."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS[:2]], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def plain_engine(tiny_checkpoint):
    """What an engine without speculation generates: greedy (run) and seeded."""
    llm = make_llm(tiny_checkpoint)
    try:
        yield {"greedy": run(llm), "seeded": sample_seeded(llm)}
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def without_speculation(plain_engine):
    return plain_engine["greedy"]


@pytest.fixture(scope="module")
def dspark_llm(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint, speculative_config=DSPARK, disable_log_stats=False)
    yield llm
    close_llm(llm)


def test_drafts_and_confidences_match_the_reference(dspark_llm, tiny_checkpoint):
    assert_drafts_match_the_reference(dspark_llm, tiny_checkpoint, PROMPTS)


def test_greedy_output_is_that_of_decoding_without_speculation(dspark_llm, without_speculation):
    assert run(dspark_llm) == without_speculation


def test_sampling_goes_through_the_rejection_sampler(dspark_llm):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    outputs = dspark_llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS[:2]], params)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)


def test_a_step_without_drafts_samples_as_a_plain_step(dspark_llm, plain_engine):
    """Nothing to verify: no rejection sampler, and the tokens of an engine without
    speculation, greedy and seeded. With drafts, the rejection sampler verifies them."""
    runner = runner_of(dspark_llm)
    gate, sampler = runner.drafter.gate, runner.rejection_sampler
    calls = []
    forward = sampler.forward
    sampler.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    try:
        gate.decide = lambda cost, requests, batch: 0
        assert run(dspark_llm) == plain_engine["greedy"]
        assert sample_seeded(dspark_llm) == plain_engine["seeded"]
        assert calls == []
        gate.decide = lambda cost, requests, batch: requests
        assert run(dspark_llm) == plain_engine["greedy"]
        assert calls
    finally:
        del gate.decide, sampler.forward


def test_no_draft_reaches_past_max_tokens(dspark_llm):
    """A request drafts at most the tokens it has left after the next: its last steps
    draft less, the step that samples its second-to-last token nothing."""
    drafter = runner_of(dspark_llm).drafter
    propose, seen = drafter.propose_step, []

    def recorded(scheduler_output, sampled, counted, req_ids, seconds, room=None):
        drafts = propose(scheduler_output, sampled, counted, req_ids, seconds, room)
        seen.append((list(req_ids), list(counted), list(room), [len(d) for d in drafts]))
        return drafts

    drafter.propose_step = recorded
    drafter.gate.decide = lambda cost, requests, batch: requests
    try:
        outputs = generate(dspark_llm, PROMPTS[:3], NEW_TOKENS, prompt_logprobs=False)
    finally:
        del drafter.propose_step, drafter.gate.decide
    prompts = {o.request_id.split("-")[0]: len(o.prompt_token_ids) for o in outputs}
    cut = 0
    for req_ids, counted, room, lengths in seen:
        for req_id, tokens, row_room, length in zip(req_ids, counted, room, lengths):
            prompt = prompts[req_id.split("-")[0]]
            assert row_room == max(prompt + NEW_TOKENS - tokens - 1, 0), req_id
            assert length <= row_room
            cut += tokens - prompt > 0 and row_room < 5
    assert cut >= 3  # every request came near its limit while drafting


def test_counters_reach_llm_get_metrics(dspark_llm):
    def counters():
        values = {}
        for metric in dspark_llm.get_metrics():
            if metric.name.startswith("deepinfer:spec_decode"):
                key = (metric.name, metric.labels.get("position"))
                values[key] = values.get(key, 0) + metric.value
        return values

    before = counters()
    generate(dspark_llm, PROMPTS[:3], NEW_TOKENS, prompt_logprobs=False)
    after = counters()
    delta = {k: after[k] - before.get(k, 0) for k in after}

    def get(name, position=None):
        return delta.get((f"deepinfer:spec_decode_{name}", position), 0)

    assert get("proposed_tokens") > 0
    assert get("verified_tokens") <= get("proposed_tokens")
    assert get("accepted_tokens") <= get("verified_tokens")
    per_position = [get("verified_tokens_per_pos", str(i)) for i in range(5)]
    assert sum(per_position) == get("verified_tokens")
    assert per_position == sorted(per_position, reverse=True)  # prefixes
    assert get("calibrated_drafts") <= get("verified_tokens")
    assert 0 <= get("confidence_sum") <= get("calibrated_drafts")
    assert get("calibrated_accepted") <= get("calibrated_drafts")
    # 3 prompts, NEW_TOKENS each: every token after the first is sampled in a decode step.
    assert get("request_steps") >= 3 * (NEW_TOKENS - 1) - get("accepted_tokens")
    assert 0 < get("decode_steps") <= get("request_steps")
    assert get("skipped_draft_steps") <= get("decode_steps")
    assert get("proposed_tokens") <= 5 * get("request_steps")


# Last: closing an in-process engine tears down the process groups the module's
# engines share.
@pytest.mark.parametrize(
    "spec, varlen", [(CUSTOM, "1"), (DSPARK, "0")], ids=["custom_class-varlen", "dspark-fixed"]
)
def test_other_ways_in_are_lossless_too(spec, varlen, tiny_checkpoint, without_speculation):
    with envs.overridden(DEEPINFER_ENABLE_MTP_VARLEN=varlen):
        llm = make_llm(tiny_checkpoint, speculative_config=spec)
    try:
        drafter = runner_of(llm).drafter
        assert type(drafter).__name__ == "DSparkProposer"
        assert drafter.varlen is (varlen == "1")
        assert run(llm) == without_speculation
    finally:
        close_llm(llm)


def test_release_quantized_stages_match_the_reference(quantized_checkpoint):
    """MXFP8 stage linears and main_proj, MXFP4 stage experts, kept as stored."""
    llm = make_llm(quantized_checkpoint, speculative_config=DSPARK)
    try:
        assert_drafts_match_the_reference(llm, quantized_checkpoint, PROMPTS[2:3])
    finally:
        close_llm(llm)
