"""Patch seeded_sampling: a seeded request whose prefill is chunked no longer kills the
CPU engine core (vLLM's runner rewinds its generator with get_offset/set_offset, which CPU
generators lack), and gives the tokens it gives when its prefill is not chunked.

Each engine test runs the seeded requests twice on one engine with a small budget: first
cold (every prompt is longer than the budget, so its prefill is chunked and the runner
samples and discards a token per partial chunk), then again, when the prefix cache holds
all but the prompt's last block, so the rest is prefilled in one step."""

import inspect
import shutil

import numpy as np
import pytest
import requests
import torch

from helpers import SERVED_NAME, close_llm, make_llm, random_prompts, serve
from vllm_deepinfer import envs

BUDGET = 32
PROMPT_LENGTHS = (150, 97)
NEW_TOKENS = 8


def runner_class():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


@pytest.fixture
def unpatched_runner(monkeypatch):
    """GPUModelRunner with upstream's own methods for this test (whatever this process had
    is put back afterwards)."""
    cls = runner_class()
    for name in ("_sample", "_bookkeeping_sync"):
        monkeypatch.setattr(cls, name, inspect.unwrap(getattr(cls, name)))
    return cls


# --- feature detection --------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.model_runner_v1
def test_apply_installs_once():
    from vllm_deepinfer.patches import seeded_sampling

    assert seeded_sampling.apply() is True
    cls = runner_class()
    wrapped = (cls._sample, cls._bookkeeping_sync)
    assert seeded_sampling.apply() is True
    assert (cls._sample, cls._bookkeeping_sync) == wrapped  # not wrapped twice
    assert all(getattr(f, "_deepinfer_seeded_sampling", False) for f in wrapped)


@pytest.mark.unit
@pytest.mark.model_runner_v1
def test_refuses_a_runner_that_no_longer_rewinds_with_set_offset(unpatched_runner, monkeypatch):
    from vllm_deepinfer.patches import seeded_sampling
    from vllm_deepinfer.patches.base import PatchUnavailable

    def _bookkeeping_sync(
        self, scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens
    ):
        return self.discard_request_mask, self.input_batch.generators

    monkeypatch.setattr(unpatched_runner, "_bookkeeping_sync", _bookkeeping_sync)
    with pytest.raises(PatchUnavailable, match="set_offset"):
        seeded_sampling.apply()
    assert unpatched_runner._bookkeeping_sync is _bookkeeping_sync
    assert not getattr(unpatched_runner._sample, "_deepinfer_seeded_sampling", False)


@pytest.mark.unit
@pytest.mark.model_runner_v1
def test_refuses_a_runner_without_sample(unpatched_runner, monkeypatch):
    from vllm_deepinfer.patches import seeded_sampling
    from vllm_deepinfer.patches.base import PatchUnavailable

    monkeypatch.delattr(unpatched_runner, "_sample")
    with pytest.raises(PatchUnavailable, match="_sample"):
        seeded_sampling.apply()
    assert not getattr(unpatched_runner._bookkeeping_sync, "_deepinfer_seeded_sampling", False)


@pytest.mark.unit
@pytest.mark.model_runner_v1
def test_not_needed_when_cpu_generators_have_offsets(unpatched_runner, monkeypatch):
    from vllm_deepinfer.patches import seeded_sampling

    assert not seeded_sampling._cpu_generators_have_offsets()  # the reason it exists
    monkeypatch.setattr(seeded_sampling, "_cpu_generators_have_offsets", lambda: True)
    assert seeded_sampling.apply() is False
    assert not getattr(unpatched_runner._sample, "_deepinfer_seeded_sampling", False)


# --- the mechanism, on a stand-in runner ---------------------------------------------------


@pytest.mark.unit
def test_rewind_puts_back_the_pre_sample_state_of_discarded_rows_only():
    """Row 0 is a partial prefill (discarded), row 1 keeps its token; the stand-in samples
    one number per seeded row and rewinds discarded rows the way vLLM's runner does."""
    from types import SimpleNamespace

    from vllm_deepinfer.patches import seeded_sampling

    class Runner:
        def __init__(self):
            self.generators = {row: torch.Generator().manual_seed(row) for row in (0, 1)}
            self.input_batch = SimpleNamespace(generators=self.generators, num_reqs=2)
            self.discard_request_mask = SimpleNamespace(np=np.array([True, False]))

        def _sample(self):
            return {
                row: torch.randint(0, 2**31, (1,), generator=g).item()
                for row, g in self.input_batch.generators.items()
            }

        def _bookkeeping_sync(self):
            for row in self.discard_request_mask.np.nonzero()[0]:
                g = self.input_batch.generators.get(int(row))
                g.set_offset(g.get_offset() - 4)

    runner = Runner()
    before = {row: g.get_state() for row, g in runner.generators.items()}
    sample = seeded_sampling._wrap_sample(Runner._sample)
    bookkeeping = seeded_sampling._wrap_bookkeeping_sync(Runner._bookkeeping_sync)
    first = sample(runner)
    bookkeeping(runner)
    assert torch.equal(runner.generators[0].get_state(), before[0])
    assert not torch.equal(runner.generators[1].get_state(), before[1])
    assert runner.input_batch.generators is runner.generators  # the real dict is back
    assert sample(runner)[0] == first[0]  # the discarded row draws the same number again
    with pytest.raises(RuntimeError, match="does not use offset"):
        Runner._bookkeeping_sync(runner)  # what upstream does on its own


# --- engines -------------------------------------------------------------------------------


def seeded(llm, prompts, seed):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=NEW_TOKENS, ignore_eos=True)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def check_chunked_equals_whole(llm, prompts):
    from vllm_deepinfer import patches

    assert patches.STATUS["seeded_sampling"].state == patches.APPLIED  # by register()
    chunked = seeded(llm, prompts, seed=7)
    for prompt, out in zip(prompts, chunked):
        assert len(prompt) > BUDGET and not out.num_cached_tokens  # prefill was chunked
    whole = seeded(llm, prompts, seed=7)
    remainders = [len(p) - (o.num_cached_tokens or 0) for p, o in zip(prompts, whole)]
    assert sum(remainders) <= BUDGET, remainders  # all prefilled in one step
    assert tokens(chunked) == tokens(whole)
    other_seed = seeded(llm, prompts, seed=8)
    for seven, eight in zip(tokens(whole), tokens(other_seed)):
        assert seven != eight


@pytest.fixture(scope="module")
def v41_llm(tiny_checkpoint):
    # Exact mode: a hit then reuses every cache, so the repeat prefills in one step.
    with envs.overridden(DEEPINFER_YOCO_PREFILL_KEEP_TOKENS="0"):
        llm = make_llm(tiny_checkpoint, max_num_batched_tokens=BUDGET)
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def llama_dir(tiny_checkpoint, tmp_path_factory):
    """vLLM's own LlamaForCausalLM (weights: load_format=dummy) with the tiny checkpoint's
    tokenizer."""
    import json

    model_dir = tmp_path_factory.mktemp("llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_checkpoint}/{name}", model_dir / name)
    with open(f"{tiny_checkpoint}/config.json") as f:
        checkpoint_config = json.load(f)
    vocab_size = checkpoint_config.get("text_config", checkpoint_config)["vocab_size"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    return str(model_dir)


@pytest.fixture(scope="module")
def llama_llm(llama_dir):
    # vLLM's CPU attention wants blocks of a multiple of 32.
    llm = make_llm(llama_dir, load_format="dummy", max_num_batched_tokens=BUDGET, block_size=32)
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def llama_server(llama_dir, tmp_path_factory):
    with serve(
        llama_dir,
        tmp_path_factory.mktemp("serve-llama"),
        "--load-format",
        "dummy",
        "--block-size",
        "32",
        "--max-num-batched-tokens",
        "256",
        front_end=False,
    ) as base:
        yield base


@pytest.mark.engine
def test_v41_seeded_chunked_prefill_equals_one_step_prefill(v41_llm):
    check_chunked_equals_whole(v41_llm, random_prompts(PROMPT_LENGTHS, seed=21))


@pytest.mark.engine
def test_llama_seeded_chunked_prefill_equals_one_step_prefill(llama_llm):
    check_chunked_equals_whole(llama_llm, random_prompts(PROMPT_LENGTHS, seed=22))


# --- server --------------------------------------------------------------------------------

SERVER_PROMPT_LENGTH = 600  # both servers' prefill budget is 256 tokens


def complete(base, prompts, seed):
    body = {
        "model": SERVED_NAME,
        "prompt": prompts,
        "max_tokens": NEW_TOKENS,
        "temperature": 1.0,
        "seed": seed,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    response = requests.post(f"{base}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] for c in choices]


@pytest.mark.server
@pytest.mark.parametrize(
    "server",
    # vLLM's Llama served (a server of its own): the slow run; its engine runs above
    ["api_server", pytest.param("llama_server", marks=pytest.mark.slow)],
)
def test_server_seeded_requests_sharing_a_prefill_budget(request, server):
    """The plugin's V4.1 and vLLM's own Llama, each served with a 256-token prefill budget:
    one request with three prompts, each longer than the budget, so every prefill is
    chunked. The repeat finds them in the prefix cache and
    prefills what is left in one step; the tokens are the same and the server lives."""
    base = request.getfixturevalue(server)
    prompts = random_prompts((SERVER_PROMPT_LENGTH,) * 3, seed=23)
    first = complete(base, prompts, seed=7)
    assert requests.get(f"{base}/health", timeout=10).status_code == 200
    again = complete(base, prompts, seed=7)
    assert again == first
    assert complete(base, prompts[:1], seed=7) == first[:1]
