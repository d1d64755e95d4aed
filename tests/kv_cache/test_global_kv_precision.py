"""Global KV at the release's precisions in the engine: `--kv-cache-dtype nvfp4_ds_mla`
(NVFP4 compressed latents) and `indexer_kv_dtype=mxfp4` (MXFP4 index keys) store the
records of kv_cache/precision.py; the window caches stay in the model dtype.

The engine computes what the reference computes with the same rounding of those caches.
The comparison is by distribution, not per position: a value within float noise of a
4-bit rounding boundary can round the other way in the engine (other summation orders)
and move the positions after it, which a per-position tolerance would call a failure."""

import pytest
import torch

from fixtures.reference import ReferenceV41
from helpers import close_llm, generate, make_llm, random_prompts
from vllm_deepinfer.kv_cache.precision import MXFP4_INDEX_KEY, NVFP4_LATENT

pytestmark = pytest.mark.engine


def logprob_errors(reference, prompt, output, **replay) -> torch.Tensor:
    """|engine - reference| of every prompt and sampled logprob of one request."""
    completion = output.outputs[0]
    tokens = prompt + list(completion.token_ids)
    expected = reference.logits(tokens[:-1], **replay).log_softmax(-1)
    entries = list(enumerate(output.prompt_logprobs or [], start=0))[1:]
    entries += [(len(prompt) + i, e) for i, e in enumerate(completion.logprobs)]
    return torch.tensor(
        [abs(e[tokens[i]].logprob - expected[i - 1, tokens[i]].item()) for i, e in entries]
    )


def test_release_precision_global_kv_matches_the_reference_with_its_rounding(tiny_checkpoint):
    llm = make_llm(
        tiny_checkpoint,
        max_model_len=1024,
        kv_cache_dtype="nvfp4_ds_mla",
        attention_config={"indexer_kv_dtype": "mxfp4"},
    )
    try:
        caches = llm.collective_rpc(
            lambda worker: {
                name: (str(layer.kv_cache.dtype), layer.kv_cache.shape[-1])
                for name, layer in worker.model_runner.compilation_config.static_forward_context.items()
                if hasattr(layer, "kv_cache")
            }
        )[0]
        prompts = random_prompts((40, 300), seed=30)
        outputs = generate(llm, prompts)
        repeated = generate(llm, prompts[1:], prompt_logprobs=False)  # a replayed hit
    finally:
        close_llm(llm)
    assert caches["model.layers.2.attn.compressed_kv"] == ("torch.uint8", 288)
    assert caches["model.layers.6.attn.index_k"] == ("torch.uint8", 68)
    assert caches["model.layers.2.attn.swa_kv"] == ("torch.float32", 512)
    assert repeated[0].num_cached_tokens == 288
    replay = dict(replays=[(288 - 140, 288)], kept_from=300 - 140)
    rounded = ReferenceV41(tiny_checkpoint, records=(NVFP4_LATENT, MXFP4_INDEX_KEY))
    full = ReferenceV41(tiny_checkpoint)
    errors = {}
    for name, reference in (("rounded", rounded), ("full", full)):
        errors[name] = torch.cat(
            [logprob_errors(reference, p, o) for p, o in zip(prompts, outputs)]
            + [logprob_errors(reference, prompts[1], repeated[0], **replay)]
        )
    assert errors["rounded"].median() < 2e-3
    assert (errors["rounded"] < 2e-3).float().mean() > 0.6
    assert errors["full"].median() > 50 * errors["rounded"].median()  # the records count
