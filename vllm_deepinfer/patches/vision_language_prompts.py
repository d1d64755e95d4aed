"""vLLM's own routes render a vision-language V4.1 checkpoint's messages with vLLM's V4.1
prompt encoder, the image token spelled as the checkpoint's tokenizer spells it.

Why: vLLM picks its V4.1 encoder (`--tokenizer-mode deepseek_v41`) by default for the
class name `DeepseekV41ForCausalLM` only. A checkpoint with a vision tower resolves to
the plugin's `DeepseekV41VLForCausalLM` (patch `vision_language_arch`), so vLLM's routes
that render messages (`/tokenize`, `/invocations`, batch chat, count_tokens) fall back to
Hugging Face's chat template, which the release does not ship: every message request
there was a 400 ("default chat template is no longer allowed"), and count_tokens logged
a traceback for each. vLLM's encoder also writes the image placeholder as
`<｜deepseek_image｜>`, while the token it stands for (id 129264, which deepseek-recipe
emits and the image processor keys on) is spelled `<｜image｜>` in the release's
tokenizer, as deepseek-recipe spells it: the placeholder would be encoded as plain text.

How: `ModelConfig.__post_init__` is wrapped: a model config left at tokenizer mode
`auto` whose class is the plugin's vision-language class gets `deepseek_v41`, as vLLM
gives the text class. `get_deepseek_v41_tokenizer` (which vLLM's V4.1 tokenizer and its
pickling call) is wrapped: where the checkpoint's tokenizer spells the image token
otherwise than vLLM's encoder, the rendered prompt's placeholders are respelled before
it is encoded.

Upstream symbols: vllm.config.model.ModelConfig.__post_init__,
vllm.tokenizers.deepseek_v41.get_deepseek_v41_tokenizer (and its module's
IMAGE_PLACEHOLDER); written against vLLM 0.32.

Remove when: vLLM defaults the tokenizer mode per model type rather than per class name,
and its encoder takes the image token's spelling from the tokenizer."""

from __future__ import annotations

import functools

from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.patches.base import (
    PatchUnavailable,
    installed,
    upstream_method,
    upstream_symbols,
)

logger = init_logger(__name__)

UPSTREAM = (
    "vllm.config.model.ModelConfig.__post_init__, "
    "vllm.tokenizers.deepseek_v41.get_deepseek_v41_tokenizer"
)
TOKENIZER_MODE = "deepseek_v41"
_MARK = "_deepinfer_vision_language_prompts"


def _upstream():
    """(ModelConfig, vLLM's V4.1 tokenizer module)."""
    try:
        from vllm.config.model import ModelConfig
        from vllm.tokenizers import deepseek_v41
    except ImportError as exc:
        raise PatchUnavailable(f"vLLM's model config or V4.1 tokenizer ({exc})") from exc
    upstream_method(ModelConfig, "__post_init__", "ModelConfig.__post_init__")
    upstream_symbols(
        (deepseek_v41, "get_deepseek_v41_tokenizer"), (deepseek_v41, "IMAGE_PLACEHOLDER")
    )
    return ModelConfig, deepseek_v41


def _default_tokenizer_mode(model_config_cls, vl_arch: str) -> None:
    original = model_config_cls.__post_init__
    if installed(original, _MARK):
        return

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.tokenizer_mode == "auto" and getattr(self, "_architecture", None) == vl_arch:
            self.tokenizer_mode = TOKENIZER_MODE
            logger.info("Defaulting to tokenizer_mode=%r for %s", TOKENIZER_MODE, vl_arch)

    setattr(__post_init__, _MARK, True)
    model_config_cls.__post_init__ = __post_init__


def _respelling_images(module, image_token_id: int) -> None:
    original = module.get_deepseek_v41_tokenizer
    if installed(original, _MARK):
        return
    placeholder = module.IMAGE_PLACEHOLDER

    @functools.wraps(original)
    def get_deepseek_v41_tokenizer(tokenizer):
        wrapped = original(tokenizer)
        spelling = tokenizer.convert_ids_to_tokens(image_token_id)
        if not isinstance(spelling, str) or spelling == placeholder:
            return wrapped

        class Respelled(wrapped.__class__):
            def apply_chat_template(self, messages, tools=None, **kwargs):
                tokenize = kwargs.pop("tokenize", True)
                prompt = super().apply_chat_template(messages, tools, tokenize=False, **kwargs)
                prompt = prompt.replace(placeholder, spelling)
                if not tokenize:
                    return prompt
                limits = {k: kwargs[k] for k in ("truncation", "max_length") if k in kwargs}
                return self.encode(prompt, add_special_tokens=False, **limits)

        Respelled.__name__ = wrapped.__class__.__name__
        wrapped.__class__ = Respelled
        return wrapped

    setattr(get_deepseek_v41_tokenizer, _MARK, True)
    module.get_deepseek_v41_tokenizer = get_deepseek_v41_tokenizer


def apply() -> bool:
    """Idempotent; True once both wrappers are installed."""
    from vllm_deepinfer.model.deepseek_v41.args import IMAGE_TOKEN_ID
    from vllm_deepinfer.model.deepseek_v41.registration import VL_ARCH

    model_config_cls, module = _upstream()
    _default_tokenizer_mode(model_config_cls, VL_ARCH)
    _respelling_images(module, IMAGE_TOKEN_ID)
    return True
