"""DSpark and variable-length verification on vLLM's V1 runner, for the plugin's V4.1.

vLLM 0.32 implements DSpark and adaptive verification only in its V2 GPU runner, so on V1
(the CPU's) `VllmConfig` refuses `method="dspark"` and `enable_adaptive_verification`
("Model Runner V1 does not support: ..."), and adaptive verification also demands full
CUDA graphs. The plugin drafts with the checkpoint's DSpark stages on V1
(spec_decode/dspark/) and verifies variable-length drafts without CUDA graphs, so for
configs its V4.1 serves the two refusals are dropped; every other V1 refusal, and the
adaptive-verification checks for LoRA and pipeline parallelism, stay. Other models are
untouched.

Upstream symbols: vllm.config.VllmConfig._get_v1_model_runner_unsupported_features and
vllm.config.VllmConfig._validate_adaptive_verification. Remove when vLLM's V1 runner
accepts DSpark for models that bring their own drafter (or V2 runs on the CPU).
"""
from __future__ import annotations

import functools

from vllm_deepinfer.patches.base import PatchUnavailable, installed, source_of

UPSTREAM = ("vllm.config.VllmConfig._get_v1_model_runner_unsupported_features, "
            "vllm.config.VllmConfig._validate_adaptive_verification")
_MARK = "_deepinfer_dspark_v1"
REFUSED = ("dspark speculative decoding", "adaptive draft verification")


def check_upstream():
    try:
        from vllm.config import VllmConfig
    except ImportError as exc:
        raise PatchUnavailable(f"vllm.config.VllmConfig cannot be imported ({exc})") from exc
    found = []
    for name in ("_get_v1_model_runner_unsupported_features",
                 "_validate_adaptive_verification"):
        method = getattr(VllmConfig, name, None)
        if method is None:
            raise PatchUnavailable(f"vllm.config.VllmConfig.{name} is missing")
        found.append(method)
    unsupported, validate = found
    source = source_of(unsupported, "_get_v1_model_runner_unsupported_features")
    if not any(text in source for text in REFUSED):
        return None  # V1 no longer refuses DSpark: nothing to drop
    return VllmConfig, unsupported, validate


def apply(serves_model) -> bool:
    """`serves_model(model_config)`: whether the plugin's V4.1 serves the config."""
    found = check_upstream()
    if found is None:
        return False
    VllmConfig, unsupported, validate = found
    if installed(unsupported, _MARK):
        return True

    def ours(config) -> bool:
        return config.model_config is not None and serves_model(config.model_config)

    @functools.wraps(unsupported)
    def v1_unsupported(self) -> list[str]:
        features = unsupported(self)
        return [f for f in features if f not in REFUSED] if ours(self) else features

    @functools.wraps(validate)
    def validate_adaptive_verification(self) -> None:
        spec = self.speculative_config
        if not ours(self) or not spec or not spec.enable_adaptive_verification:
            return validate(self)
        if self.lora_config is not None:
            raise ValueError("Adaptive verification is not currently compatible with LoRA")
        if self.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("Adaptive verification is not currently compatible "
                             "with pipeline parallelism")

    setattr(v1_unsupported, _MARK, True)
    VllmConfig._get_v1_model_runner_unsupported_features = v1_unsupported
    VllmConfig._validate_adaptive_verification = validate_adaptive_verification
    return True
