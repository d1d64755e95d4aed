"""Images into V4.1 prompts through vLLM's multimodal processing.

The release's preprocessing (pixel limits, aspect-ratio limit, padding to whole patches,
the token budget, the reading-order span of start / rows + newline / end) is upstream
vLLM's port of DeepSeek's `image_processor.py`, which runs anywhere: it is reused as it
is. What differs here is the placeholder: the checkpoint's tokenizer may spell the image
token however it likes, so the span is keyed on its id (`IMAGE_TOKEN_ID`, which
deepseek-recipe renders) rather than on upstream's spelling.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from vllm.models.deepseek_v41.common.mm_preprocess import (DeepseekV4VLDummyInputsBuilder,
                                                           DeepseekV4VLImageProcessor,
                                                           DeepseekV4VLMultiModalProcessor,
                                                           DeepseekV4VLProcessingInfo,
                                                           num_image_tokens)
from vllm.multimodal.inputs import MultiModalKwargsItems
from vllm.multimodal.parse import MultiModalDataItems
from vllm.multimodal.processing import PromptReplacement, PromptUpdate, PromptUpdateDetails

from vllm_deepinfer.model.deepseek_v41.args import IMAGE_TOKEN_ID

DEFAULT_IMAGE_PLACEHOLDER = "<｜image｜>"
"""deepseek-recipe's spelling of IMAGE_TOKEN_ID, for callers that place images by text."""


class V41ImageProcessingInfo(DeepseekV4VLProcessingInfo):
    def get_image_placeholder_token_id(self) -> int:
        return IMAGE_TOKEN_ID

    def image_placeholder(self) -> str:
        """The tokenizer's own spelling of the image token."""
        return self.get_tokenizer().convert_ids_to_tokens(IMAGE_TOKEN_ID)


class V41ImageDummyInputs(DeepseekV4VLDummyInputsBuilder):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return self.info.image_placeholder() * mm_counts.get("image", 0)


class V41ImageProcessor(DeepseekV4VLMultiModalProcessor):
    def _get_prompt_updates(self, mm_items: MultiModalDataItems,
                            hf_processor_mm_kwargs: Mapping[str, object],
                            out_mm_kwargs: MultiModalKwargsItems) -> Sequence[PromptUpdate]:
        """Each placeholder becomes the image's whole span, every position carrying the
        image token id (the MoE routes it with `bias_vl`, Engram reads it as a gap); the
        span's roles travel in the item's `types`."""

        def span(item_idx: int) -> PromptUpdateDetails:
            length = out_mm_kwargs["image"][item_idx]["types"].data.numel()
            return PromptUpdateDetails.select_token_id([IMAGE_TOKEN_ID] * length,
                                                       IMAGE_TOKEN_ID)

        return [PromptReplacement(modality="image", target=[IMAGE_TOKEN_ID],
                                  replacement=span)]


def image_span_length(hf_config, image) -> int:
    """Prompt tokens `image` takes once the release's preprocessing has sized it."""
    *_, cell_rows, cell_cols = DeepseekV4VLImageProcessor(hf_config)(image)
    return num_image_tokens(cell_rows, cell_cols)
