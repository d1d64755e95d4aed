"""Every sampling parameter on every speculative path: one batch holding a request per
parameter set and prompt runs on an engine without speculation, with DSpark's
variable-length verification and with fixed-length verification. The first request of
each prompt is a cold prefill; the others of the same prompt hit the prefix cache it
wrote and are recomputed by bounded replay. Greedy requests give the tokens decoding
without speculation gives (logprobs within LOGPROB_TOLERANCE); sampled tokens lie inside
the sampler's top-k / top-p support; what vLLM does not support with speculation is
refused by name; and the engine is alive and right afterwards. (A request with top_k
killed a DSpark engine core: patches/cpu_spec_sampling.py.)"""

import pytest
from sampling_matrix import NEW_TOKENS, assert_matrix, greedy_tokens, refusals, run_matrix

from helpers import close_llm, make_llm, random_prompts
from vllm_deepinfer import envs

pytestmark = pytest.mark.engine

DSPARK = {"method": "dspark", "num_speculative_tokens": 5}
# Verification runs differently shaped steps than plain decoding; in fp32 a cold
# chunked prefill's logprobs moved by up to 0.011 (tokens equal) on this model, whose
# indexer top-k has near-ties. Hits and the other positions agree to 1e-4.
LOGPROB_TOLERANCE = 2e-2
# Longer than the replay keep (140) by more than a block, so the second pass replays.
PROMPTS = random_prompts([300, 170], seed=11)
STRUCTURED = {"backend": "xgrammar", "disable_any_whitespace": True}
# The whole batch runs at once; the 300-token prompt's cold prefill is still chunked.
ENGINE = dict(structured_outputs_config=STRUCTURED, max_num_seqs=32, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def without_speculation(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint, **ENGINE)
    try:
        cold = greedy_tokens(llm, PROMPTS[0])
        stop_token = cold[NEW_TOKENS // 2]
        yield (
            cold,
            run_matrix(llm, PROMPTS, stop_token),
            refusals(llm, PROMPTS[1]),
            greedy_tokens(llm, PROMPTS[0]),
        )
    finally:
        close_llm(llm)


@pytest.mark.parametrize(
    "varlen",
    # Fixed-length drafting (DEEPINFER_ENABLE_MTP_VARLEN=0) is also verified in the default
    # run by tests/determinism and tests/spec_decode/test_dspark_trained.py.
    [
        pytest.param("1", id="dspark-varlen"),
        pytest.param("0", id="dspark-fixed", marks=pytest.mark.slow),
    ],
)
def test_every_parameter_on_every_speculative_path(varlen, tiny_checkpoint, without_speculation):
    plain_cold, plain, plain_refusals, plain_after = without_speculation
    stop_token = plain_cold[NEW_TOKENS // 2]
    assert not any(plain_refusals.values()), plain_refusals  # supported without speculation
    with envs.overridden(DEEPINFER_ENABLE_MTP_VARLEN=varlen):
        llm = make_llm(tiny_checkpoint, speculative_config=DSPARK, **ENGINE)
    try:
        assert greedy_tokens(llm, PROMPTS[0]) == plain_cold
        assert_matrix(
            run_matrix(llm, PROMPTS, stop_token),
            plain,
            stop_token,
            llm.get_tokenizer(),
            LOGPROB_TOLERANCE,
        )
        for name, message in refusals(llm, PROMPTS[1]).items():
            assert name in message, (name, message)  # refused, naming the parameter
        # Alive and still right after all of it (a hit, replayed as the plain engine's
        # hits were).
        assert greedy_tokens(llm, PROMPTS[0]) == plain_after
    finally:
        close_llm(llm)
