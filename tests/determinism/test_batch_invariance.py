"""Batch-invariant inference and deterministic sampling on the engine (DEEPINFER_BATCH_INVARIANT=1,
DEEPINFER_DETERMINISTIC_SAMPLING=1, bounded replay off): a request's tokens and logprobs
are bit-identical alone and in a batch of 32 mixed-length requests with chunked prefill,
at any position, on a prefix-cache hit and a miss, after an engine restart with another
chunk budget and preemption, and with fixed-length DSpark speculation, greedy and seeded.

The engines run in processes of their own (helpers.batch_invariant_env says why).
`test_determinism_parts.py` shows each fixed-order part in-process."""

import random

import pytest
from sampling_matrix import assert_matrix, greedy_tokens, parameter_sets, refusals, run_matrix

from helpers import batch_invariant_env, close_llm, make_llm, random_prompts
from vllm_deepinfer import envs

pytestmark = pytest.mark.engine

_LENGTHS = random.Random(12).choices(range(5, 300), k=32)
PROMPTS = random_prompts(_LENGTHS, seed=12)
NEW_TOKENS = 10
# Requests that outgrow a 130-block KV space: one is preempted and recomputed.
PREEMPTED = random_prompts((60, 70, 80, 90), seed=24)
PREEMPTED_TOKENS = 150
# Deterministic sampling brings exact mode (bounded replay off) by itself.
SETTINGS = dict(DEEPINFER_DETERMINISTIC_SAMPLING="1", DEEPINFER_ENABLE_MTP_VARLEN="0")
DSPARK = {"method": "dspark", "num_speculative_tokens": 5}
SPREAD = sorted({*range(0, 32, 5), max(range(32), key=_LENGTHS.__getitem__)})
"""A spread of the 32 prompts (every fifth and the longest) for the slower engines."""
MATRIX_PROMPTS = [PROMPTS[0], PROMPTS[SPREAD[-1]]]
"""The sampling-parameter matrix (tests/sampling_matrix.py) runs on these."""


def invariant_llm(checkpoint: str, **overrides):
    with envs.overridden(**batch_invariant_env(**SETTINGS)):
        return make_llm(
            checkpoint, **{"max_num_seqs": 32, "max_num_batched_tokens": 64, **overrides}
        )


def params(index: int, seeded: bool, new_tokens: int):
    """Greedy, or sampled with a per-request seed (temperature, top-k and top-p all in
    play); sampled logprobs of the top 2 besides the chosen token."""
    from vllm import SamplingParams

    if not seeded:
        return SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=2, ignore_eos=True)
    return SamplingParams(
        max_tokens=new_tokens,
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        seed=1000 + index,
        logprobs=2,
        ignore_eos=True,
    )


def run(llm, indices, seeded: bool, prompts=PROMPTS, new_tokens=NEW_TOKENS) -> dict[int, tuple]:
    """{prompt index: (tokens, [(token, logprob) per candidate] per step, cached tokens)}."""
    from vllm.inputs import TokensPrompt

    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=prompts[i]) for i in indices],
        [params(i, seeded, new_tokens) for i in indices],
        use_tqdm=False,
    )
    return {
        i: (
            list(o.outputs[0].token_ids),
            [sorted((t, p.logprob) for t, p in step.items()) for step in o.outputs[0].logprobs],
            o.num_cached_tokens or 0,
        )
        for i, o in zip(indices, outputs)
    }


def same(a: dict, b: dict) -> list[int]:
    """The indices whose tokens or logprobs differ."""
    return [i for i in b if a[i][:2] != b[i][:2]]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    llm = invariant_llm(tiny_checkpoint)
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def batch_of_32(llm):
    """Every prompt in one batch, greedy then seeded; the first run of each prompt (no
    prefix-cache hit)."""
    return run(llm, range(32), seeded=False), run(llm, range(32), seeded=True)


@pytest.fixture(scope="module")
def matrix(llm):
    """The sampling-parameter matrix on the batch-invariant engine without speculation:
    (stop token, results, refusals)."""
    stop_token = greedy_tokens(llm, MATRIX_PROMPTS[0])[5]
    return stop_token, run_matrix(llm, MATRIX_PROMPTS, stop_token), refusals(llm, PROMPTS[1])


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_alone_equals_in_a_batch_of_32(llm, batch_of_32, seeded):
    """Alone, each of these prompts finds its prefix cached by the batch (a hit, exact
    mode recomputes the rest) and is chunked differently: still bit-identical."""
    batch = batch_of_32[seeded]
    alone = {}
    for i in (0, 9, 31, max(range(32), key=_LENGTHS.__getitem__)):
        alone |= run(llm, [i], seeded)
    assert all(alone[i][2] > 0 for i in alone if _LENGTHS[i] > 16)  # prefix-cache hits
    assert same(batch, alone) == []


def test_a_seeded_request_gives_the_same_text_on_a_miss_and_a_hit(llm):
    """Under deterministic sampling (exact mode, which it brings: the keep setting is left
    unset here) a seeded request at temperature 0.8, first a miss, then a 384-token hit,
    longer than bounded replay's default keep (140), which would recompute it
    approximately: the same tokens and logprobs."""
    prompt = random_prompts((400,), seed=13)
    miss, hit = run(llm, [0], True, prompt), run(llm, [0], True, prompt)
    assert (miss[0][2], hit[0][2]) == (0, 384)
    assert same(miss, hit) == []


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_position_in_the_batch_does_not_matter(llm, batch_of_32, seeded):
    reordered = run(llm, [*range(31, 15, -1), *range(16)], seeded)
    assert same(batch_of_32[seeded], reordered) == []


@pytest.mark.slow  # a second batch-invariant engine (~65 s): docs/development.md's neighbours
def test_a_restart_chunking_and_preemption_change_nothing(llm, tiny_checkpoint, batch_of_32):
    """A second engine with 32-token chunks and a KV space of 130 blocks: every other
    prompt that fits its 256-token limit, and PREEMPTED, whose requests outgrow the space (one is
    preempted and recomputed)."""
    fitting = [i for i in range(0, 32, 2) if _LENGTHS[i] + NEW_TOKENS <= 256]
    preempted_alone = run(llm, range(4), False, PREEMPTED, PREEMPTED_TOKENS)
    restarted = invariant_llm(
        tiny_checkpoint,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=130,
        max_model_len=256,
        disable_log_stats=False,
    )
    try:
        greedy, seeded = run(restarted, fitting, False), run(restarted, fitting, True)
        preempted = run(restarted, range(4), False, PREEMPTED, PREEMPTED_TOKENS)
        preemptions = sum(
            m.value for m in restarted.get_metrics() if m.name == "vllm:num_preemptions"
        )
    finally:
        close_llm(restarted)
    assert preemptions > 0
    assert same(preempted_alone, preempted) == []
    assert same(batch_of_32[False], greedy) == []
    assert same(batch_of_32[True], seeded) == []


def test_verifying_accepted_drafts_equals_decoding_them(tiny_checkpoint, batch_of_32, tmp_path):
    """Drafts that are the reference continuation are accepted: each verification pass
    computes up to 6 positions of a request at once, and the tokens and logprobs are those
    of decoding one token a step, greedy (a third of the prompts) and seeded (another
    third), in one engine."""
    import json
    import os

    chosen = {
        False: [i for i in range(32) if i % 3 == 0],
        True: [i for i in range(32) if i % 3 == 1],
    }
    path = tmp_path / "continuations.json"
    path.write_text(
        json.dumps(
            [
                {"prompt": PROMPTS[i], "continuation": batch_of_32[seeded][i][0]}
                for seeded, indices in chosen.items()
                for i in indices
            ]
        )
    )
    oracle = {
        "method": "custom_class",
        "num_speculative_tokens": 5,
        "model": "oracle_proposer.OracleProposer",
    }
    with envs.overridden(
        ORACLE_CONTINUATIONS=str(path),
        PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
    ):
        speculative = invariant_llm(
            tiny_checkpoint, speculative_config=oracle, disable_log_stats=False
        )
    try:
        outputs = {seeded: run(speculative, indices, seeded) for seeded, indices in chosen.items()}
        accepted = sum(
            m.value
            for m in speculative.get_metrics()
            if m.name == "vllm:spec_decode_num_accepted_tokens"
        )
    finally:
        close_llm(speculative)
    assert accepted >= sum(map(len, chosen.values())) * (NEW_TOKENS - 2)  # nearly every draft
    for seeded in chosen:
        assert same(batch_of_32[seeded], outputs[seeded]) == []


@pytest.mark.slow  # ~90 s; the default run keeps the oracle's verification above
def test_fixed_length_speculation_leaves_no_trace(tiny_checkpoint, batch_of_32, matrix):
    """DSpark verifying 5 drafts a step gives the tokens and logprobs of decoding one token
    a step, greedy and seeded (verification samples each position as decoding does), on a
    spread of the 32 prompts batched together (the longest among them); every sampling
    parameter is served on both engines, the same bits for greedy requests and the same
    draws for seeded ones, and what vLLM does not support with speculation is refused by
    name."""
    stop_token, plain, plain_refusals = matrix
    speculative = invariant_llm(tiny_checkpoint, speculative_config=DSPARK)
    try:
        greedy, seeded = run(speculative, SPREAD, False), run(speculative, SPREAD, True)
        results = run_matrix(speculative, MATRIX_PROMPTS, stop_token)
        speculative_refusals = refusals(speculative, PROMPTS[1])
        tokenizer = speculative.get_tokenizer()
        alive = greedy_tokens(speculative, MATRIX_PROMPTS[0])
    finally:
        close_llm(speculative)
    assert same(batch_of_32[False], greedy) == []
    assert same(batch_of_32[True], seeded) == []
    assert_matrix(results, plain, stop_token, tokenizer, logprob_tolerance=1e-6)
    assert not any(plain_refusals.values()), plain_refusals
    for name, message in speculative_refusals.items():
        assert name in message, (name, message)
    seeded_sets = {name for name, options in parameter_sets().items() if "seed" in options}
    assert [
        key
        for key in results
        if key[0] in seeded_sets
        and [tokens for tokens, _ in results[key]] != [tokens for tokens, _ in plain[key]]
    ] == []  # deterministic sampling: the same draws with speculation
    assert alive == batch_of_32[False][0][0]
