"""V4.1 compiled by vLLM, as `vllm serve` and `LLM(...)` run it without flags: the
compiled engine gives the eager engine's greedy tokens and logprobs (fp32 tolerance) on
mixed batches, chunked long prompts (decoder-side replay trims rows after the cut layer)
and prefix hits recomputed by bounded replay, with and without DSpark (whose stages
compile into a graph of their own, drafting as the reference does); a second start
with the same model and settings loads the compiled model from vLLM's compile cache
instead of compiling it again. Each engine here compiles into a cache of this module."""

import pytest

from helpers import (
    assert_drafts_match_the_reference,
    close_llm,
    generate,
    make_llm,
    random_prompts,
)

pytestmark = pytest.mark.engine

LOGPROB_TOLERANCE = 1e-4
# Cut by the 64-token chunk budget; 300 > the 140-token replay keep (decoder-side replay),
# and the long prompt comes again for a prefix hit.
PROMPTS = random_prompts([5, 40, 300, 23], seed=11)
DSPARK = {"method": "dspark", "num_speculative_tokens": 5}


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """vLLM's compile cache for this module only: the first start compiles."""
    path = str(tmp_path_factory.mktemp("vllm-cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", path)
        yield path


def run(llm):
    """(tokens, logprobs of the chosen tokens) of PROMPTS, then of the long prompt again
    (a prefix hit, recomputed by bounded replay) beside a fresh prompt."""
    outputs = generate(llm, PROMPTS, 12, prompt_logprobs=False)
    outputs += generate(
        llm, [PROMPTS[2], random_prompts([50], seed=12)[0]], 12, prompt_logprobs=False
    )
    return [
        (
            list(o.outputs[0].token_ids),
            [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
        )
        for o in outputs
    ]


def assert_same(compiled, eager):
    for (tokens, logprobs), (eager_tokens, eager_logprobs) in zip(compiled, eager, strict=True):
        assert tokens == eager_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, eager_logprobs)) < LOGPROB_TOLERANCE


def compiles_and_loads():
    from vllm.compilation.counter import compilation_counter

    return compilation_counter.num_aot_compiles, compilation_counter.num_aot_artifacts_loaded


@pytest.fixture(scope="module")
def eager(tiny_checkpoint):
    """An `enforce_eager` engine's outputs of `run`, with its compilation mode and whether
    its model skips compiling."""
    llm = make_llm(tiny_checkpoint, enforce_eager=True)
    try:
        config = llm.llm_engine.vllm_config.compilation_config
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        return run(llm), config.mode, model.model.do_not_compile
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def eager_outputs(eager):
    return eager[0]


def test_enforce_eager_does_not_compile(eager):
    from vllm.config import CompilationMode

    _, mode, do_not_compile = eager
    assert mode == CompilationMode.NONE and do_not_compile


def test_compiled_equals_eager_and_restarts_from_the_compile_cache(
    tiny_checkpoint, compile_cache, eager_outputs
):
    compiled_before, loaded_before = compiles_and_loads()
    llm = make_llm(tiny_checkpoint, enforce_eager=False)
    try:
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        assert not model.model.do_not_compile
        assert compiles_and_loads() == (compiled_before + 1, loaded_before)
        assert_same(run(llm), eager_outputs)
    finally:
        close_llm(llm)
    llm = make_llm(tiny_checkpoint, enforce_eager=False)  # same model, same settings
    try:
        assert compiles_and_loads() == (compiled_before + 1, loaded_before + 1)
        assert_same(run(llm), eager_outputs)
    finally:
        close_llm(llm)


def test_compiled_dspark_drafts_as_the_reference_and_equals_eager_without_speculation(
    tiny_checkpoint, compile_cache, eager_outputs
):
    """The target compiled, and DSpark's stages in a compiled graph of their own, warmed
    up with the target: the drafts are the reference's, and verification keeps greedy
    decoding lossless."""
    compiled_before, _ = compiles_and_loads()
    llm = make_llm(tiny_checkpoint, enforce_eager=False, speculative_config=DSPARK)
    try:
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        draft = model.model.draft
        assert not draft.do_not_compile
        assert compiles_and_loads()[0] == compiled_before + 2  # target and stages, at start
        assert_drafts_match_the_reference(llm, tiny_checkpoint, PROMPTS[1:3])
        compiled = run(llm)
    finally:
        close_llm(llm)
    assert [tokens for tokens, _ in compiled] == [tokens for tokens, _ in eager_outputs]
