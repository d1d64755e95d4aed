"""Chooses which DeepseekV41ForCausalLM vLLM builds (DEEPINFER_MODEL_IMPL)."""

from __future__ import annotations

from vllm_deepinfer import envs
from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)

ARCH = "DeepseekV41ForCausalLM"
PLUGIN_MODEL = "vllm_deepinfer.model.deepseek_v41.model:DeepseekV41ForCausalLM"
VL_ARCH = "DeepseekV41VLForCausalLM"
"""The name vLLM resolves a V4.1 checkpoint with a vision tower to (the release names both
forms `ARCH`; the `vision_language_arch` patch tells them apart)."""
PLUGIN_VL_MODEL = "vllm_deepinfer.model.deepseek_v41.vision_language:DeepseekV41VLForCausalLM"
DSPARK_PROPOSER = "vllm_deepinfer.spec_decode.dspark.proposer.DSparkProposer"
"""The plugin's DSpark proposer as `method="custom_class"` names it."""

_choice_logged = False


def upstream_supports_platform() -> bool:
    """Upstream's V4.1 runs only on NVIDIA or ROCm GPUs with Model Runner V2, which
    needs Triton and must not be switched off."""
    from vllm import envs as vllm_envs
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    gpu = current_platform.is_cuda() or current_platform.is_rocm()
    return gpu and HAS_TRITON and vllm_envs.VLLM_USE_V2_MODEL_RUNNER is not False


def resolve_impl(requested: str) -> str:
    if requested == "auto":
        return "vllm" if upstream_supports_platform() else "deepinfer"
    return requested


def is_v41(model_config) -> bool:
    architectures = getattr(model_config, "architectures", None) or []
    return ARCH in architectures or VL_ARCH in architectures


def uses_dspark_stages(vllm_config) -> bool:
    """Whether speculative decoding drafts with the checkpoint's DSpark stages: vLLM's
    `method="dspark"`, or the plugin's proposer named as a custom class. Never without
    Model Runner V1, which the plugin's drafter runs in (vllm_support.py)."""
    from vllm_deepinfer.vllm_support import has_model_runner_v1

    spec = vllm_config.speculative_config
    model_config = vllm_config.model_config
    if (
        spec is None
        or model_config is None
        or not is_v41(model_config)
        or not has_model_runner_v1()
    ):
        return False
    return spec.method == "dspark" or (
        spec.method == "custom_class" and spec.model == DSPARK_PROPOSER
    )


def register_deepseek_v41() -> str:
    """Registers the plugin's model unless upstream's is chosen; returns the choice."""
    global _choice_logged
    settings = envs.load()
    impl = resolve_impl(settings.model_impl)
    if impl == "deepinfer":
        from vllm import ModelRegistry

        from vllm_deepinfer.model.deepseek_v41 import quantization

        ModelRegistry.register_model(ARCH, PLUGIN_MODEL)
        ModelRegistry.register_model(VL_ARCH, PLUGIN_VL_MODEL)
        quantization.register()
    if not _choice_logged:
        _choice_logged = True
        logger.info(
            "DEEPINFER_MODEL_IMPL=%s: %s serves %s",
            settings.model_impl,
            "vllm-deepinfer" if impl == "deepinfer" else "upstream vLLM",
            ARCH,
        )
    return impl


def replay_keep(vllm_config) -> int:
    """The replay length the plugin's V4.1 runs with under this config; 0 for other models
    and in exact mode."""
    from vllm_deepinfer.kv_cache.bounded_replay import replay_settings
    from vllm_deepinfer.model.deepseek_v41.args import V41Args

    model_config = vllm_config.model_config
    if (
        model_config is None
        or not is_v41(model_config)
        or resolve_impl(envs.load().model_impl) != "deepinfer"
    ):
        return 0
    return replay_settings(vllm_config, V41Args.from_hf_config(model_config.hf_config)).keep
