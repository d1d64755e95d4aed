"""Bounded replay and decoder-side replay in the engine, against the reference forward
that specifies them (ReferenceV41.logits with a replay start, the hit and kept_from).

The tiny model's window is 32 and its decoder-side replay cut is layer 6: with keep 141 a
replay starts mid ratio-2 group (hits end on 16-token block boundaries, so s = hit - 141
is odd), with keep 32 on a block boundary; keep 32 is also where decoder-side replay
approximates (from about 94 rows on it is exact on this model). Requests that want
prompt logprobs are never trimmed and never read the prefix cache (vLLM recomputes them).
With keep 40 a replayed admission's approximate compressed KV, cached and read by later
hits, makes a chain of replays the reference follows (also on SECOND_LAYOUT: another
window, layer count and compress-ratio layout), as do preemptions (natural ones, and a
request preempted mid-prefill, mid-decode and during a replay). Near-tied indexer top-k
selections are compared taken either way (helpers.ReferenceRows).
"""

import time

import pytest

from fixtures.reference import ReferenceV41
from fixtures.tiny import SECOND_LAYOUT, write_checkpoint
from helpers import (
    ReferenceRows,
    assert_matches_reference,
    close_llm,
    expected_replay,
    generate,
    make_llm,
    random_prompts,
    sampled_as_reference,
)
from vllm_deepinfer import envs

pytestmark = pytest.mark.engine


def replay_llm(checkpoint: str, keep: int, **overrides):
    """An engine built with DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=keep (read when the model
    and the stat logger are built)."""
    with envs.overridden(DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=str(keep)):
        return make_llm(
            checkpoint, **{"max_model_len": 1024, "disable_log_stats": False, **overrides}
        )


def replay_of(llm, output) -> list[tuple[int, int, int]]:
    """The engine's admissions of this request: (replay start, kept_from, tokens held)."""
    stats = llm.collective_rpc("deepinfer_replay_stats")[0]
    return [
        (start, kept, held)
        for req_id, start, kept, held in stats["admissions"]
        if req_id == output.request_id or req_id.startswith(f"{output.request_id}-")
    ]


def counter(llm, name: str) -> int:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return ReferenceV41(tiny_checkpoint)


@pytest.fixture(scope="module")
def base_prompt():
    return random_prompts((420,), seed=20)[0]


def test_replay_mid_group_and_short_hits_match_reference(tiny_checkpoint, reference, base_prompt):
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


def test_decoder_side_replay_under_a_small_chunk_budget(tiny_checkpoint, reference, base_prompt):
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


def assert_admissions_match_reference(reference, prompt, completion, admissions, keep):
    """Each generated token matches the reference of the admission that sampled it, whose
    hit holds the compressed KV the admissions before it wrote (a resumed admission's
    hit N replays from N - keep; a hit no longer than keep was recomputed whole), with
    the reference's near-tied top-k selections taken either way."""
    tokens = list(completion.token_ids)
    hits = [(start, start + keep if start else 0) for start, _, _ in admissions[1:]]
    references = [
        ReferenceRows(
            reference, prompt + tokens[:-1], len(prompt) - 1, replays=hits[:k], kept_from=kept
        )
        for k, (_, kept, _) in enumerate(admissions)
    ]
    for i, (token, entry) in enumerate(zip(tokens, completion.logprobs)):
        row = len(prompt) - 1 + i
        sampled_by = max(k for k, (_, _, held) in enumerate(admissions) if held - 1 <= row)
        rows = references[sampled_by]
        assert rows.matches(row, sampled_as_reference(token, entry[token].logprob)), (
            f"token {i} (admission {sampled_by} of {admissions}): engine {token} at "
            f"{entry[token].logprob:.5f}, reference {rows.at(row).argmax().item()} at "
            f"{rows.at(row)[token].item():.5f}; near ties {rows.ties}"
        )


@pytest.fixture(scope="module")
def keep_40(tiny_checkpoint):
    """keep 40, 32-token chunks (a replay of 40 rows takes two steps), a KV space of 130
    blocks, synchronous scheduling (preempted_three_times preempts between steps)."""
    llm = replay_llm(
        tiny_checkpoint,
        40,
        num_gpu_blocks_override=130,
        max_model_len=256,
        max_num_batched_tokens=32,
        async_scheduling=False,
    )
    yield llm
    close_llm(llm)


def test_preempted_requests_replay_from_their_resumed_hit(keep_40, reference):
    """Requests that outgrow a small KV space are preempted and resume from a hit on
    their own cached blocks, replayed from its last 40 tokens (vLLM's V1 runner sends no
    replay start for resumed requests; the worker derives it). Re-admissions at the same
    replay start (the hit's blocks are kept, the replay writes none) chain alike."""
    llm, keep = keep_40, 40
    preemptions = counter(llm, "vllm:num_preemptions")
    prompts = random_prompts((60, 70, 80, 90), seed=24)
    outputs = generate(llm, prompts, new_tokens=150, prompt_logprobs=False)
    preemptions = counter(llm, "vllm:num_preemptions") - preemptions
    resumed = 0
    for prompt, output in zip(prompts, outputs):
        admissions = replay_of(llm, output)
        resumed += sum(start > 0 for start, _, _ in admissions[1:])
        assert_admissions_match_reference(reference, prompt, output.outputs[0], admissions, keep)
    assert preemptions > 0 and resumed > 0


def preempted_three_times(llm, prompt: list[int], new_tokens: int, keep: int):
    """Generates greedily for `prompt` alone, preempting it mid-prefill, mid-decode and
    while its second resumption replays (its hit's last keep tokens, recomputed over
    several steps), as vLLM preempts for KV space. Returns the finished output."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    engine.add_request(f"thrice-{len(prompt)}", TokensPrompt(prompt_token_ids=prompt), params)
    moments = [
        lambda r: keep < r.num_computed_tokens < r.num_prompt_tokens,  # mid-prefill
        lambda r: r.num_output_tokens >= new_tokens // 3,  # mid-decode
        lambda r: r.replay_start and r.num_computed_tokens < r.replay_start + keep,  # replaying
    ]
    preempted, finished = 0, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            finished = output if output.finished else finished
        if scheduler.running and preempted < len(moments):
            (request,) = scheduler.running
            if request.num_computed_tokens and moments[preempted](request):
                # As vLLM's reset_prefix_cache preempts running requests between steps.
                scheduler.running.remove(request)
                scheduler._preempt_request(request, time.monotonic())
                scheduler.prev_step_scheduled_req_ids.discard(request.request_id)
                preempted += 1
    assert preempted == len(moments)
    return finished


def assert_preempted_three_times(llm, reference, prompt, keep, starts):
    """preempted_three_times, then: its admissions replayed from `starts`, and every
    token matches the reference of the admission that sampled it."""
    output = preempted_three_times(llm, prompt, 60, keep)
    admissions = replay_of(llm, output)
    assert [start for start, _, _ in admissions] == starts
    assert_admissions_match_reference(reference, prompt, output.outputs[0], admissions, keep)


def test_a_request_preempted_three_times_replays_each_resumed_hit(keep_40, reference):
    """Preempted mid-prefill (resumes from a 64-token hit), mid-decode and in the middle
    of the replay that resumption started (resumes from the same hit again): every token
    matches the reference of the admission that sampled it."""
    assert_preempted_three_times(
        keep_40, reference, random_prompts((100,), seed=28)[0], 40, [0, 24, 72, 72]
    )


def test_a_hit_on_blocks_a_replay_wrote_reads_its_approximate_kv(keep_40, reference):
    """A replayed admission's compressed KV is approximate, cached, and what a later hit
    on its blocks reads: three hits, each on blocks the previous (replayed) one wrote,
    equal the reference's chain of replays, and the deepest differs from a single
    replay of an exact prefix (the chain is what the engine computes). A hit shorter than
    its writer's own hit reads only blocks written before it (one replay)."""
    llm, keep = keep_40, 40
    first, *tails = random_prompts((240, 40, 40, 20, 30), seed=26)
    chain = assert_chained_hits(llm, reference, first, zip((160, 192, 224), tails), keep)
    assert chain == [(120, 160), (152, 192), (184, 224)]
    shorter = first[:144] + tails[3]
    (output,) = generate(llm, [shorter], new_tokens=4, prompt_logprobs=False)
    assert output.num_cached_tokens == 144
    replay = expected_replay(shorter, 144, keep, written_under=chain)
    assert replay["replays"] == [(104, 144)]
    assert_matches_reference(reference, shorter, output, **replay)


def assert_chained_hits(llm, reference, first, hits_and_tails, keep):
    """Generates `first`, then for each (hit, tail) the previous prompt's first `hit`
    tokens and `tail`: each hits the blocks the previous one wrote and matches the
    reference's chain of replays; the last one does not match a single replay of an
    exact prefix. Returns the chain."""
    generate(llm, [first], new_tokens=1, prompt_logprobs=False)
    chain, prompt = [], first
    for hit, tail in hits_and_tails:
        prompt = prompt[:hit] + tail
        (output,) = generate(llm, [prompt], new_tokens=4, prompt_logprobs=False)
        assert output.num_cached_tokens == hit
        replay = expected_replay(prompt, hit, keep, written_under=chain)
        assert_matches_reference(reference, prompt, output, **replay)
        chain = replay["replays"]
    assert not reference_agrees(reference, prompt, output, **expected_replay(prompt, hit, keep))
    return chain


def reference_agrees(reference, prompt, output, **replay) -> bool:
    """Whether every sampled token is the reference's (`replay`), within the tolerance."""
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    logprobs = reference.logits(prompt + tokens[:-1], last_rows=len(tokens), **replay).log_softmax(
        -1
    )
    return all(
        sampled_as_reference(token, entry[token].logprob)(logprobs[i])
        for i, (token, entry) in enumerate(zip(tokens, completion.logprobs))
    )


@pytest.fixture(scope="module")
def second_layout(tmp_path_factory):
    """SECOND_LAYOUT (window 24, seven layers, a ratio-1 group before a ratio-2 one) with
    keep 45: hits end on block boundaries, so replays start mid ratio-2 group and mid
    block; 32-token chunks and synchronous scheduling, as keep_40. Its reference."""
    checkpoint = write_checkpoint(
        str(tmp_path_factory.mktemp("ckpt") / "tiny-v41-second"), text_overrides=SECOND_LAYOUT
    )
    llm = replay_llm(
        checkpoint,
        45,
        num_gpu_blocks_override=200,
        max_model_len=512,
        max_num_batched_tokens=32,
        async_scheduling=False,
    )
    yield llm, ReferenceV41(checkpoint)
    close_llm(llm)


def test_second_layout_chains_hits_and_preemptions(second_layout):
    """On another window, layer count and compress-ratio layout: a hit on blocks a
    replayed admission wrote reads them (the reference's chain, not a single replay of
    an exact prefix), and a request preempted mid-prefill, mid-decode and during a
    replay matches the reference of each of its admissions."""
    (llm, reference), keep = second_layout, 45
    first, *tails = random_prompts((200, 40, 30), seed=29)
    chain = assert_chained_hits(llm, reference, first, zip((160, 192), tails), keep)
    assert chain == [(115, 160), (147, 192)]
    assert_preempted_three_times(
        llm, reference, random_prompts((100,), seed=30)[0], keep, [0, 19, 67, 67]
    )


def test_keep_at_the_bound_is_exact_and_exact_mode_keeps_every_cache(
    tiny_checkpoint, reference, base_prompt
):
    """keep >= (SWA layers) x (W - 1) = 10 x 31: a replayed hit gives the exact result.
    keep 0 (exact mode, the behaviour before replay): hits of any length, even 64 tokens,
    reuse every cache and are exact."""
    tails = random_prompts((30, 21), seed=25)
    for keep, prompts in (
        (310, [base_prompt[:400] + tails[0]]),
        (0, [base_prompt[:400] + tails[0], base_prompt[:64] + tails[1]]),
    ):
        llm = replay_llm(tiny_checkpoint, keep)
        try:
            generate(llm, [base_prompt], new_tokens=1, prompt_logprobs=False)
            outputs = generate(llm, prompts, prompt_logprobs=False)
            assert [o.num_cached_tokens for o in outputs] == [400, 64][: len(prompts)]
            for prompt, output in zip(prompts, outputs):
                assert_matches_reference(reference, prompt, output)
            replayed = llm.collective_rpc("deepinfer_replay_stats")[0]["replayed_rows"]
            assert replayed == (keep if keep else 0)
        finally:
            close_llm(llm)
