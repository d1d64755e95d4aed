"""Bounded replay and decoder-side replay in the engine, against the reference forward
that specifies them (ReferenceV41.logits with a replay start, the hit and kept_from).

The tiny model's window is 32 and its decoder-side replay cut is layer 6: with keep 141 a
replay starts mid ratio-2 group (hits end on 16-token block boundaries, so s = hit - 141
is odd), with keep 32 on a block boundary; keep 32 is also where decoder-side replay
approximates (from about 94 rows on it is exact on this model). Requests that want
prompt logprobs are never trimmed and never read the prefix cache (vLLM recomputes them).
"""
import pytest
from helpers import (assert_matches_reference, close_llm, expected_replay, generate, make_llm,
                     random_prompts)

from vllm_deepinfer import envs
from vllm_deepinfer.model.reference import ReferenceV41

pytestmark = pytest.mark.engine

def replay_llm(checkpoint: str, keep: int, **overrides):
    """An engine built with DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=keep (read when the model
    and the stat logger are built)."""
    with envs.overridden(DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=str(keep)):
        return make_llm(checkpoint, **{"max_model_len": 1024, "disable_log_stats": False,
                                       **overrides})


def replay_of(llm, output) -> list[tuple[int, int, int]]:
    """The engine's admissions of this request: (replay start, kept_from, tokens held)."""
    stats = llm.collective_rpc("deepinfer_replay_stats")[0]
    return [(start, kept, held) for req_id, start, kept, held in stats["admissions"]
            if req_id == output.request_id or req_id.startswith(f"{output.request_id}-")]


def counter(llm, name: str) -> int:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return ReferenceV41(tiny_checkpoint)


@pytest.fixture(scope="module")
def base_prompt():
    return random_prompts((420,), seed=20)[0]


def test_replay_mid_group_and_short_hits_match_reference(tiny_checkpoint, reference,
                                                         base_prompt):
    """keep 141: a 352-token hit replays from 211 (mid ratio-2 group), a prompt that ends
    mid group; a 128-token hit is dropped and recomputed whole; a fresh prompt is trimmed
    by decoder-side replay; all in one batch. The counters say what was replayed and
    saved, beside vLLM's hit counters, which count the replayed tokens as cached."""
    keep = 141
    llm = replay_llm(tiny_checkpoint, keep)
    try:
        generate(llm, [base_prompt], new_tokens=1, prompt_logprobs=False)
        tails = random_prompts((37, 20, 300), seed=21)
        prompts = [base_prompt[:352] + tails[0], base_prompt[:128] + tails[1], tails[2]]
        hits_before = counter(llm, "vllm:prefix_cache_hits")
        outputs = generate(llm, prompts, prompt_logprobs=False)
        assert [o.num_cached_tokens for o in outputs] == [352, 0, 0]
        for prompt, output in zip(prompts, outputs):
            replay = expected_replay(prompt, output.num_cached_tokens, keep)
            start = replay["replays"][0][0] if replay["replays"] else 0
            assert replay_of(llm, output) == [(start, replay["kept_from"], len(prompt))]
            assert_matches_reference(reference, prompt, output, **replay)
        assert counter(llm, "vllm:prefix_cache_hits") - hits_before == 352
        assert counter(llm, "deepinfer:prefix_replayed_tokens") == keep
        assert counter(llm, "deepinfer:prefix_saved_tokens") == 352 - keep
    finally:
        close_llm(llm)


def test_decoder_side_replay_under_a_small_chunk_budget(tiny_checkpoint, reference,
                                                        base_prompt):
    """keep = window = 32 and 16-token chunks: hits replay from a block boundary, fresh
    prompts run layers 6-9 on their last 32 rows only, in mixed batches with decodes
    and with a request that wants prompt logprobs (never trimmed). The approximation is
    live: the long prompts differ from the exact forward by more than the tolerance."""
    keep = 32
    llm = replay_llm(tiny_checkpoint, keep, max_num_batched_tokens=16)
    try:
        generate(llm, [base_prompt], new_tokens=1, prompt_logprobs=False)
        fresh = random_prompts((50, 97, 301), seed=22)
        prompts = [base_prompt[:256] + fresh[0][:9], base_prompt[:400], *fresh]
        outputs = generate(llm, prompts, prompt_logprobs=False)
        assert [o.num_cached_tokens for o in outputs[:2]] == [256, 384]
        approximate = 0
        for prompt, output in zip(prompts, outputs):
            replay = expected_replay(prompt, output.num_cached_tokens, keep)
            assert all(start % 16 == 0 for start, _ in replay["replays"])
            assert_matches_reference(reference, prompt, output, **replay)
            completion = output.outputs[0]
            exact = reference.logits(prompt).log_softmax(-1)[-1]
            token = completion.token_ids[0]
            approximate += abs(exact[token].item() - completion.logprobs[0][token].logprob) > 0.05
        assert approximate >= 2
        every_row = random_prompts((120,), seed=23)
        (output,) = generate(llm, every_row, prompt_logprobs=True)
        assert replay_of(llm, output) == [(0, 0, 120)]
        assert_matches_reference(reference, every_row[0], output)
    finally:
        close_llm(llm)


@pytest.mark.xfail(strict=False, reason=(
    "known defect, reproduced at 8ee396c on this machine: a request preempted 5 times, "
    "re-admitted twice at the same replay start (136, then 168), differs from the "
    "reference's replay chain by 0.03 in logprob at row 199; with 1-2 preemptions it "
    "passed. Open: bounded replay under repeated preemption"))
def test_preempted_requests_replay_from_their_resumed_hit(tiny_checkpoint, reference):
    """Requests that outgrow a small KV space are preempted and resume from a hit on
    their own cached blocks, replayed from its last 40 tokens (vLLM's V1 runner sends no
    replay start for resumed requests; the worker derives it). Each generated token
    matches the reference of the admission that sampled it, whose hit holds the global
    KV the admissions before it wrote."""
    keep = 40
    llm = replay_llm(tiny_checkpoint, keep, num_gpu_blocks_override=130, max_model_len=256)
    try:
        prompts = random_prompts((60, 70, 80, 90), seed=24)
        outputs = generate(llm, prompts, new_tokens=150, prompt_logprobs=False)
        preemptions = counter(llm, "vllm:num_preemptions")
        resumed = 0
        for prompt, output in zip(prompts, outputs):
            admissions = replay_of(llm, output)
            resumed += sum(start > 0 for start, _, _ in admissions[1:])
            tokens = list(output.outputs[0].token_ids)
            hits = [(start, start + keep if start else 0) for start, _, _ in admissions[1:]]
            references = [reference.logits(prompt + tokens[:-1], replays=hits[:k],
                                           kept_from=kept).log_softmax(-1)
                          for k, (_, kept, _) in enumerate(admissions)]
            for i, (token, entry) in enumerate(zip(tokens, output.outputs[0].logprobs)):
                row = len(prompt) - 1 + i
                sampled_by = max(k for k, (_, _, held) in enumerate(admissions)
                                 if held - 1 <= row)
                expected = references[sampled_by][row]
                assert expected.argmax().item() == token
                assert entry[token].logprob == pytest.approx(expected[token].item(), abs=2e-3)
    finally:
        close_llm(llm)
    assert preemptions > 0 and resumed > 0


def test_keep_at_the_bound_is_exact_and_exact_mode_keeps_every_cache(tiny_checkpoint,
                                                                      reference, base_prompt):
    """keep >= (SWA layers) x (W - 1) = 10 x 31: a replayed hit gives the exact result.
    keep 0 (exact mode, the behaviour before replay): hits of any length, even 64 tokens,
    reuse every cache and are exact."""
    tails = random_prompts((30, 21), seed=25)
    for keep, prompts in ((310, [base_prompt[:400] + tails[0]]),
                          (0, [base_prompt[:400] + tails[0], base_prompt[:64] + tails[1]])):
        llm = replay_llm(tiny_checkpoint, keep)
        try:
            generate(llm, [base_prompt], new_tokens=1, prompt_logprobs=False)
            outputs = generate(llm, prompts, prompt_logprobs=False)
            assert [o.num_cached_tokens for o in outputs] == [400, 64][:len(prompts)]
            for prompt, output in zip(prompts, outputs):
                assert_matches_reference(reference, prompt, output)
            replayed = llm.collective_rpc("deepinfer_replay_stats")[0]["replayed_rows"]
            assert replayed == (keep if keep else 0)
        finally:
            close_llm(llm)
