"""DeepSeek V4.1-Flash as the vision-language model the release is.

The text model (model.py) plus the release's vision path: upstream vLLM's ViT (2D RoPE,
bidirectional attention within an image) and spatial-merge aligner, reused as they are,
and the learned image start / newline / end vectors. `embed_multimodal` turns each image
into its whole span of embeddings; vLLM's runner merges them into the prompt's
embeddings, and the raw token ids still reach the model, where image positions (all
`IMAGE_TOKEN_ID`) route with `bias_vl` and are gaps to Engram.

vLLM builds this class for checkpoints whose `vision_config` has layers (the
`vision_language_arch` patch names it), the text class for the others.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import MultiModalEmbeddings, SupportsMultiModal
from vllm.model_executor.models.utils import _merge_multimodal_embeddings
from vllm.models.deepseek_v4.common.vision import DeepseekV4Aligner, DeepseekV4ViT
from vllm.models.deepseek_v41.common.mm_preprocess import (
    IMAGE,
    IMAGE_END,
    IMAGE_NEW_LINE,
    IMAGE_START,
    num_image_tokens,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from vllm_deepinfer.checkpoint.layout import is_vision
from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.model.deepseek_v41.image_processing import (
    DEFAULT_IMAGE_PLACEHOLDER,
    V41ImageDummyInputs,
    V41ImageProcessingInfo,
    V41ImageProcessor,
    images_per_prompt,
)
from vllm_deepinfer.model.deepseek_v41.model import DeepseekV41ForCausalLM

logger = init_logger(__name__)

SPAN_VECTORS = {IMAGE_START: "image_start", IMAGE_NEW_LINE: "image_newline", IMAGE_END: "image_end"}
"""Span roles filled by a learned vector rather than by the aligner's rows."""


class V41Aligner(DeepseekV4Aligner):
    """Upstream's aligner with its merged patches made contiguous: the unfold's transpose
    is a strided view, which vLLM's CPU linear kernels do not take."""

    def forward(self, x: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        r = self.downsample_ratio
        grid = F.pad(
            x.view(n_vit_h, n_vit_w, -1).permute(2, 0, 1), (0, -n_vit_w % r, 0, -n_vit_h % r)
        )
        merged = F.unfold(grid.unsqueeze(0), r, stride=r)[0].T.contiguous()
        hidden, _ = self.w1(merged)
        out, _ = self.w2(F.gelu(hidden))
        return out


def image_span(
    rows: torch.Tensor, types: torch.Tensor, vectors: dict[int, torch.Tensor]
) -> torch.Tensor:
    """[len(types), H]: the aligner's rows at IMAGE slots (reading order), each role's
    learned vector at the delimiters."""
    types = types.to(rows.device)
    span = rows.new_empty(types.numel(), rows.shape[-1])
    span[types == IMAGE] = rows
    for role, vector in vectors.items():
        span[types == role] = vector.to(rows.dtype)
    return span


@MULTIMODAL_REGISTRY.register_processor(
    V41ImageProcessor, info=V41ImageProcessingInfo, dummy_inputs=V41ImageDummyInputs
)
class DeepseekV41VLForCausalLM(DeepseekV41ForCausalLM, SupportsMultiModal):
    requires_raw_input_tokens = True  # bias_vl routing and Engram read the image ids

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality == "image":
            return DEFAULT_IMAGE_PLACEHOLDER
        raise ValueError(f"DeepSeek V4.1 takes images only, not {modality!r}")

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_config
        dtype = vllm_config.model_config.dtype
        limit = images_per_prompt(vllm_config.model_config.multimodal_config)
        # Skipped (not built, not loaded) when the image limit is 0.
        with self._mark_tower_model(vllm_config, "image"):
            self.vision = DeepseekV4ViT(config).to(dtype)
            self.aligner = V41Aligner(config).to(dtype)
        if limit:
            for name in SPAN_VECTORS.values():
                self.register_parameter(
                    name, nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
                )
            logger.info(
                "V4.1 vision-language: a %d-layer vision tower, images of up to %d "
                "tokens, at most %d per prompt",
                config.vision_n_layers,
                config.vision_max_n_token,
                limit,
            )
        else:
            logger.info(
                "V4.1 vision-language checkpoint with images off "
                "(--limit-mm-per-prompt image=0): the vision tower is not loaded"
            )

    def _build_language_model(self, vllm_config: VllmConfig, prefix: str) -> None:
        """Marked as the language model, so that vLLM skips it (not built, not loaded) on
        an encoder-only instance."""
        with self._mark_language_model(vllm_config):
            super()._build_language_model(vllm_config, prefix)

    def get_language_model(self) -> nn.Module:
        return self  # the text model is this module, with the tower beside it

    def vision_parameters(self) -> dict[str, nn.Parameter]:
        """Nothing when the tower was skipped (image limit 0): its tensors are not read."""
        return {name: p for name, p in self.named_parameters() if is_vision(name)}

    def encode_image(
        self, patches: torch.Tensor, vit_grid: tuple[int, int], types: torch.Tensor
    ) -> torch.Tensor:
        """One image's span of embeddings from its ViT patches."""
        h, w = vit_grid
        rows = self.aligner(self.vision(patches.to(self.aligner.w1.weight.dtype), h, w), h, w)
        return image_span(
            rows, types, {role: getattr(self, name) for role, name in SPAN_VECTORS.items()}
        )

    def embed_multimodal(self, **kwargs: object) -> MultiModalEmbeddings:
        patches = kwargs.get("patches")
        if patches is None:
            return []
        spans = []
        patch_start = span_start = 0
        for (h, w), (rows, cols) in zip(
            kwargs["vit_grid"].tolist(), kwargs["llm_grid"].tolist(), strict=True
        ):
            length = num_image_tokens(rows, cols)
            spans.append(
                self.encode_image(
                    patches[patch_start : patch_start + h * w],
                    (h, w),
                    kwargs["types"][span_start : span_start + length],
                )
            )
            patch_start += h * w
            span_start += length
        return tuple(spans)

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: MultiModalEmbeddings | None = None,
        *,
        is_multimodal: torch.Tensor | None = None,
        **_,
    ) -> torch.Tensor:
        embeds = self.model.embed(input_ids)
        if not multimodal_embeddings:
            return embeds
        return _merge_multimodal_embeddings(embeds, multimodal_embeddings, is_multimodal)
