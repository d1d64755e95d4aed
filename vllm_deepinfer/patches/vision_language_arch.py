"""A V4.1 checkpoint with a vision tower is built as the plugin's vision-language class.

Why: the release names its text-only and its vision-language form alike
(`DeepseekV41ForCausalLM`), and vLLM decides from the class alone whether a model takes
images (its multimodal processor, encoder cache, profiling with dummy images). vLLM tells
such forms apart in a model-arch-config convertor, keyed by `model_type`, that rewrites
`architectures` before the class is resolved (it does so for `deepseek_v4`); it has none
for `deepseek_v41`. This patch adds one to that table: a config whose `vision_config` has
layers resolves to `DeepseekV41VLForCausalLM`; a text-only one keeps the text class (no
image machinery, no tower). Only installed where the plugin serves V4.1 (upstream's own
V4.1 class is already multimodal).

Upstream symbols: vllm.transformers_utils.model_arch_config_convertor
(MODEL_ARCH_CONFIG_CONVERTORS, ModelArchConfigConvertorBase); written against vLLM 0.32.

Remove when: vLLM lets a model plugin choose the class per configuration (then the plugin
registers that choice instead)."""

from __future__ import annotations

from vllm_deepinfer.patches.base import PatchUnavailable

UPSTREAM = "vllm.transformers_utils.model_arch_config_convertor.MODEL_ARCH_CONFIG_CONVERTORS"
MODEL_TYPE = "deepseek_v41"


def _upstream():
    try:
        from vllm.transformers_utils import model_arch_config_convertor as convertors
    except ImportError as exc:
        raise PatchUnavailable(
            f"vLLM's model-arch-config convertors cannot be imported ({exc})"
        ) from exc
    table = getattr(convertors, "MODEL_ARCH_CONFIG_CONVERTORS", None)
    base = getattr(convertors, "ModelArchConfigConvertorBase", None)
    if not isinstance(table, dict) or base is None:
        raise PatchUnavailable(
            "MODEL_ARCH_CONFIG_CONVERTORS / ModelArchConfigConvertorBase "
            "are no longer in vllm.transformers_utils."
            "model_arch_config_convertor"
        )
    return table, base


def apply() -> bool:
    """Idempotent. True once the convertor is in the table."""
    from vllm_deepinfer.model.deepseek_v41.registration import ARCH, VL_ARCH

    table, base = _upstream()
    present = table.get(MODEL_TYPE)
    if getattr(present, "_deepinfer_vision_language", False):
        return True
    if present is not None:
        raise PatchUnavailable(
            f"vLLM now has a convertor for {MODEL_TYPE} "
            f"({present.__name__}); it must choose the class itself"
        )

    class V41ArchConfigConvertor(base):
        _deepinfer_vision_language = True

        def __init__(self, hf_config, hf_text_config, revision=None):
            if getattr(hf_config, "vision_n_layers", 0) > 0 and getattr(
                hf_config, "architectures", None
            ) == [ARCH]:
                hf_config.architectures = [VL_ARCH]
            super().__init__(hf_config, hf_text_config, revision)

    table[MODEL_TYPE] = V41ArchConfigConvertor
    return True
