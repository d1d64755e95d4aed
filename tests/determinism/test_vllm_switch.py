"""vLLM's own VLLM_BATCH_INVARIANT=1 on the CPU, for a built-in model: upstream registers
Triton kernels for the CPU and the engine core dies at its first sample; with the plugin
(patches/batch_invariant_cpu.py) a built-in Llama runs, and a request's tokens and
logprobs are bit-identical alone and in a batch of 16 mixed-length requests with chunked
prefill."""

import json
import os
import sys

import pytest

from helpers import batch_invariant_env, close_llm, make_llm, random_prompts
from vllm_deepinfer import envs

pytestmark = pytest.mark.engine

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


@pytest.fixture(scope="module")
def llama_checkpoint(tiny_checkpoint, tmp_path_factory) -> str:
    """A 2-layer Llama of the tiny V4.1's width and vocabulary, random weights."""
    from throughput import llama_config_like, write_llama_checkpoint

    with open(os.path.join(tiny_checkpoint, "config.json")) as f:
        v41 = json.load(f)["text_config"]
    config = llama_config_like(v41, _param_count(v41))
    config["num_hidden_layers"] = 2
    out = str(tmp_path_factory.mktemp("llama"))
    write_llama_checkpoint(out, config, tiny_checkpoint)
    return out


def _param_count(v41: dict):
    from model_costs import v41_args, v41_param_count

    return v41_param_count(v41_args(v41))


def test_builtin_llama_is_bit_identical_alone_and_in_a_batch(llama_checkpoint):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = random_prompts(
        [5, 90, 33, 150, 12, 64, 7, 120, 48, 99, 20, 140, 3, 77, 56, 30], seed=5
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    with envs.overridden(**batch_invariant_env("VLLM_BATCH_INVARIANT")):
        llm = make_llm(llama_checkpoint, block_size=32, max_num_seqs=16, max_num_batched_tokens=64)
    try:

        def run(batch):
            outputs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False
            )
            return [
                (
                    list(o.outputs[0].token_ids),
                    [
                        sorted((t, p.logprob) for t, p in step.items())
                        for step in o.outputs[0].logprobs
                    ],
                )
                for o in outputs
            ]

        together = run(prompts)
        alone = [run([prompts[i]])[0] for i in (0, 3, 15)]
    finally:
        close_llm(llm)
    assert alone == [together[i] for i in (0, 3, 15)]
