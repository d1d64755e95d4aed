"""Images into V4.1 prompts through vLLM's multimodal processing.

The release's preprocessing (pixel limits, aspect-ratio limit, padding to whole patches,
the token budget, the reading-order span of start / rows + newline / end) is upstream
vLLM's port of DeepSeek's `image_processor.py`, which runs anywhere: it is reused as it
is. What differs here is the placeholder: the checkpoint's tokenizer may spell the image
token however it likes, so the span is keyed on its id (`IMAGE_TOKEN_ID`, which
deepseek-recipe renders) rather than on upstream's spelling.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from vllm.models.deepseek_v41.common.mm_preprocess import (
    DeepseekV4VLDummyInputsBuilder,
    DeepseekV4VLMultiModalProcessor,
    DeepseekV4VLProcessingInfo,
    num_image_tokens,
    safe_resize,
)
from vllm.multimodal.inputs import MultiModalKwargsItems
from vllm.multimodal.parse import MultiModalDataItems
from vllm.multimodal.processing import PromptReplacement, PromptUpdate, PromptUpdateDetails

from vllm_deepinfer.model.deepseek_v41.args import IMAGE_TOKEN_ID

DEFAULT_IMAGE_PLACEHOLDER = "<｜image｜>"
"""deepseek-recipe's spelling of IMAGE_TOKEN_ID, for callers that place images by text."""


DEFAULT_IMAGES_PER_PROMPT = 32
"""Images one V4.1 prompt may hold when the operator sets no `--limit-mm-per-prompt`.
vLLM's own default, 999, lets one request make the API server decode and process hundreds
of images; 32 images at the full token budget (1024 tokens each) fill a 32k context."""


def _operator_image_limit(mm_config) -> bool:
    return mm_config.limit_per_prompt.get("image") is not None


def images_per_prompt(mm_config) -> int:
    """The images one prompt may hold: the operator's `--limit-mm-per-prompt`, else
    DEFAULT_IMAGES_PER_PROMPT (0 where images are off)."""
    limit = mm_config.get_limit_per_prompt("image")
    return limit if _operator_image_limit(mm_config) else min(limit, DEFAULT_IMAGES_PER_PROMPT)


class V41ImageProcessingInfo(DeepseekV4VLProcessingInfo):
    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        """vLLM applies the smaller of this and `--limit-mm-per-prompt` (999 unset), so
        the default caps only where the operator chose no limit of their own."""
        mm_config = self.ctx.get_mm_config()
        return {"image": None if _operator_image_limit(mm_config) else DEFAULT_IMAGES_PER_PROMPT}

    def get_image_placeholder_token_id(self) -> int:
        return IMAGE_TOKEN_ID

    def image_placeholder(self) -> str:
        """The tokenizer's own spelling of the image token."""
        return self.get_tokenizer().convert_ids_to_tokens(IMAGE_TOKEN_ID)


class V41ImageDummyInputs(DeepseekV4VLDummyInputsBuilder):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return self.info.image_placeholder() * mm_counts.get("image", 0)


class V41ImageProcessor(DeepseekV4VLMultiModalProcessor):
    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargsItems,
    ) -> Sequence[PromptUpdate]:
        """Each placeholder becomes the image's whole span, every position carrying the
        image token id (the MoE routes it with `bias_vl`, Engram reads it as a gap); the
        span's roles travel in the item's `types`."""

        def span(item_idx: int) -> PromptUpdateDetails:
            length = out_mm_kwargs["image"][item_idx]["types"].data.numel()
            return PromptUpdateDetails.select_token_id([IMAGE_TOKEN_ID] * length, IMAGE_TOKEN_ID)

        return [PromptReplacement(modality="image", target=[IMAGE_TOKEN_ID], replacement=span)]


def image_span_length(hf_config, size: tuple[int, int]) -> int:
    """Prompt tokens an image of `size` (width, height) takes once the release's
    preprocessing has sized it: the sizing steps of upstream's `load_image` (aspect-ratio
    clamp, minimum pixels, whole patches, then its `safe_resize` to the token budget),
    which read no pixel, so the span is known from the image's header before decoding."""
    width, height = size
    patch, max_ratio = hf_config.vision_patch_size, hf_config.vision_max_wh_ratio
    if max_ratio is not None and width > height * max_ratio:
        width = height * max_ratio
    if 0 < width * height < hf_config.vision_min_pixels:
        scale = (hf_config.vision_min_pixels / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    rows, cols, _, _ = safe_resize(
        height,
        width,
        math.ceil(height / patch) * patch,
        math.ceil(width / patch) * patch,
        patch,
        hf_config.vision_downsample_ratio,
        hf_config.vision_max_n_token,
    )
    return num_image_tokens(rows, cols)
