"""A prompt's global KV found on disk by a new engine (a restart) gives what a local
prefix hit gives: the reference forward with the window replayed from the hit
(ReferenceV41's replay semantics). In exact mode (keep 0) the window's blocks are
persisted too and a hit after a restart equals exact computation: the ablation of
keeping only global KV. (Through servers, test_served.py checks a hit after a restart
against a local hit at the default keep; test_bounded_replay.py checks local hits
against the reference.)"""

import json

import pytest

from fixtures.reference import ReferenceV41
from helpers import (
    assert_matches_reference,
    close_llm,
    expected_replay,
    generate,
    make_llm,
    random_prompts,
)
from vllm_deepinfer import envs

pytestmark = pytest.mark.engine


def cached_engine(checkpoint: str, directory, keep: int):
    with envs.overridden(
        DEEPINFER_CONTEXT_CACHE_DIR=str(directory), DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=str(keep)
    ):
        return make_llm(checkpoint, max_model_len=1024)


def persisted_layers(directory) -> set[str]:
    [layout] = directory.glob("deepinfer-*/layout.json")
    return {name for group in json.loads(layout.read_text())["groups"] for name in group["layers"]}


@pytest.mark.parametrize("keep", [141, 0], ids=["bounded_replay", "exact"])
def test_hit_after_restart_matches_reference(tiny_checkpoint, tmp_path, keep):
    prompt = random_prompts((420,), seed=26)[0]
    llm = cached_engine(tiny_checkpoint, tmp_path, keep)
    try:
        [cold] = generate(llm, [prompt], prompt_logprobs=False)
        assert cold.num_cached_tokens == 0
    finally:
        close_llm(llm)  # stops the engine: what it stored is on disk
    llm = cached_engine(tiny_checkpoint, tmp_path, keep)
    try:
        [hit] = generate(llm, [prompt], prompt_logprobs=False)
    finally:
        close_llm(llm)
    assert hit.num_cached_tokens == 416  # every full 16-token block of the prompt
    replay = expected_replay(prompt, hit.num_cached_tokens, keep) if keep else {}
    assert_matches_reference(ReferenceV41(tiny_checkpoint), prompt, hit, **replay)
    layers = persisted_layers(tmp_path)
    assert any(name.endswith("compressed_kv") for name in layers)
    window = {name for name in layers if name.endswith(("swa_kv", "compressor_state"))}
    assert bool(window) == (keep == 0)  # the window is persisted in exact mode only
