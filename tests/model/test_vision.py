"""Images through the plugin's V4.1 inside vLLM equal the plain-PyTorch reference.

The engine runs upstream vLLM's ViT and aligner (reused) on the release's preprocessing;
the reference (model/reference_vision.py) writes the vision path out on its own. One
engine: a 16-token prefill budget, so prefills are chunked through image spans, and
prefix caching with bounded replay on.
"""

import numpy as np
import pytest
import torch
from PIL import Image

from fixtures.reference import ReferenceV41
from helpers import assert_matches_reference, close_llm, expected_replay, make_llm, random_prompts
from vllm_deepinfer.model.deepseek_v41.args import IMAGE_TOKEN_ID

pytestmark = pytest.mark.engine


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def llm(vision_checkpoint):
    llm = make_llm(vision_checkpoint, max_num_batched_tokens=16)
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def reference(vision_checkpoint):
    return ReferenceV41(vision_checkpoint)


def run(llm, requests, new_tokens=8, prompt_logprobs=True):
    """Greedy outputs of (token ids with one IMAGE_TOKEN_ID per image, images) requests."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=new_tokens,
        temperature=0.0,
        logprobs=0,
        prompt_logprobs=0 if prompt_logprobs else None,
        ignore_eos=True,
    )
    prompts = [
        {"prompt_token_ids": ids, **({"multi_modal_data": {"image": images}} if images else {})}
        for ids, images in requests
    ]
    return llm.generate(prompts, params, use_tqdm=False)


def with_placeholders(text: list[int], at: list[int]) -> list[int]:
    ids = list(text)
    for position in sorted(at, reverse=True):
        ids.insert(position, IMAGE_TOKEN_ID)
    return ids


def test_vision_tower_in_the_engine_equals_the_reference(llm, reference):
    """Upstream's ViT and aligner, loaded by the plugin and run inside vLLM, against the
    reference's own vision path on the same weights and patches."""
    from vllm.models.deepseek_v41.common.mm_preprocess import image_token_types

    images = [noise_image(112, 70, 0), noise_image(45, 150, 1), noise_image(300, 40, 2)]
    expected = reference.image_spans(images)

    def encode(model):
        from vllm.models.deepseek_v41.common.mm_preprocess import DeepseekV4VLImageProcessor

        preprocess = DeepseekV4VLImageProcessor(model.config)
        spans = []
        for image in images:
            patches, h, w, rows, cols = preprocess(image)
            spans.append(model.encode_image(patches, (h, w), image_token_types(rows, cols)))
        return spans

    [spans] = llm.apply_model(encode)
    for got, want in zip(spans, expected, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert len({s.shape[0] for s in spans}) == 3  # three sizes, three span lengths


def test_images_in_a_mixed_batch_under_chunked_prefill_match_the_reference(llm, reference):
    """One image, two images of different sizes, and text only, in one batch; every image
    span is longer than the 16-token chunk, so chunks cut through it."""
    texts = random_prompts((20, 30, 25), seed=11)
    requests = [
        (with_placeholders(texts[0], [5]), [noise_image(112, 70, 3)]),
        (with_placeholders(texts[1], [3, 20]), [noise_image(84, 126, 4), noise_image(200, 60, 5)]),
        (texts[2], []),
    ]
    outputs = run(llm, requests)
    prompt = list(outputs[0].prompt_token_ids)
    seen, blind = (
        reference.logits(prompt, images=requests[0][1], last_rows=1),
        reference.logits(prompt, last_rows=1),
    )
    assert (seen - blind).abs().max() > 1e-2  # the image is live in the logits
    for (_, images), output in zip(requests, outputs):
        prompt = list(output.prompt_token_ids)
        assert prompt.count(IMAGE_TOKEN_ID) > 16 * len(images) or not images
        assert_matches_reference(reference, prompt, output, images=images)


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(llm, reference):
    """A long prompt with an image after 200 text tokens, sent again: the second run hits
    the cache past the image (bounded replay recomputes its last 140 tokens). The same
    text with another image of the same size hits only the blocks before the image."""
    text = random_prompts((240,), seed=12)[0]
    ids = with_placeholders(text, [200])
    first, second = noise_image(140, 112, 6), noise_image(140, 112, 7)
    [cold] = run(llm, [(ids, [first])], prompt_logprobs=False)
    [warm] = run(llm, [(ids, [first])], prompt_logprobs=False)
    [other] = run(llm, [(ids, [second])], prompt_logprobs=False)
    prompt = list(warm.prompt_token_ids)
    image_end = max(i for i, t in enumerate(prompt) if t == IMAGE_TOKEN_ID) + 1
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens >= image_end  # past the whole image span
    assert other.num_cached_tokens <= 200  # up to the image, never into it
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    for output, image in ((cold, first), (warm, first), (other, second)):
        replay = expected_replay(prompt, output.num_cached_tokens, 140)
        assert_matches_reference(reference, prompt, output, images=[image], **replay)
    assert (
        other.outputs[0].token_ids != warm.outputs[0].token_ids
        or other.outputs[0].logprobs != warm.outputs[0].logprobs
    )
