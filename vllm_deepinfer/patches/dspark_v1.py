"""DSpark and variable-length verification on vLLM's V1 runner, for the plugin's V4.1.

vLLM 0.32 implements DSpark and adaptive verification only in its V2 GPU runner, so on V1
(the CPU's) `VllmConfig` refuses `method="dspark"` and `enable_adaptive_verification`
("Model Runner V1 does not support: ..."), and adaptive verification also demands full
CUDA graphs. The plugin drafts with the checkpoint's DSpark stages on V1
(spec_decode/dspark/) and verifies variable-length drafts without CUDA graphs, so for
configs its V4.1 serves the two refusals are dropped; every other V1 refusal, and the
adaptive-verification checks for LoRA and pipeline parallelism, stay. Other models are
untouched.

Where `VllmConfig._set_max_num_scheduled_tokens` also lowers `max_num_active_seqs` for
DSpark to `max_num_batched_tokens // num_lookahead_tokens` (room for V2's draft pass,
whose query rows share the step's token budget), the user's value (or None) is put back
for V4.1 on V1 on the CPU, where the plugin's runner drafts: its stages draft after the
step, outside its token budget, so the cap would only cut concurrency (64 tokens, 5
drafts: 12 active requests of 32).

Upstream symbols: vllm.config.VllmConfig._get_v1_model_runner_unsupported_features,
vllm.config.VllmConfig._validate_adaptive_verification and
vllm.config.VllmConfig._set_max_num_scheduled_tokens. Remove when vLLM's V1 runner
accepts DSpark for models that bring their own drafter (or V2 runs on the CPU).
"""

from __future__ import annotations

import functools

from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.model.deepseek_v41.registration import uses_dspark_stages
from vllm_deepinfer.patches.base import PatchUnavailable, installed, source_of

logger = init_logger(__name__)

UPSTREAM = (
    "vllm.config.VllmConfig._get_v1_model_runner_unsupported_features, "
    "vllm.config.VllmConfig._validate_adaptive_verification, "
    "vllm.config.VllmConfig._set_max_num_scheduled_tokens"
)
_MARK = "_deepinfer_dspark_v1"
REFUSED = ("dspark speculative decoding", "adaptive draft verification")
CAPPED = "max_num_active_seqs"  # what upstream lowers for the DSpark draft pass


def check_upstream():
    """Returns (VllmConfig, its three methods, whether V1 refuses DSpark, whether DSpark's
    active requests are capped); raises PatchUnavailable when a method is missing."""
    try:
        from vllm.config import VllmConfig
    except ImportError as exc:
        raise PatchUnavailable(f"vllm.config.VllmConfig cannot be imported ({exc})") from exc
    found = []
    for name in (
        "_get_v1_model_runner_unsupported_features",
        "_validate_adaptive_verification",
        "_set_max_num_scheduled_tokens",
    ):
        method = getattr(VllmConfig, name, None)
        if method is None:
            raise PatchUnavailable(f"vllm.config.VllmConfig.{name} is missing")
        found.append(method)
    unsupported, validate, reserve = found
    refuses = any(
        text in source_of(unsupported, "_get_v1_model_runner_unsupported_features")
        for text in REFUSED
    )
    caps = CAPPED in source_of(reserve, "_set_max_num_scheduled_tokens")
    return VllmConfig, unsupported, validate, reserve, refuses, caps


def apply(serves_model) -> bool:
    """`serves_model(model_config)`: whether the plugin's V4.1 serves the config. False
    (not needed) where V1 neither refuses DSpark nor caps its active requests."""
    VllmConfig, unsupported, validate, reserve, refuses, caps = check_upstream()

    def ours(config) -> bool:
        return config.model_config is not None and serves_model(config.model_config)

    if refuses and not installed(unsupported, _MARK):
        _drop_refusals(VllmConfig, unsupported, validate, ours)
    if caps and not installed(reserve, _MARK):
        _keep_active_requests(VllmConfig, reserve, ours)
    return refuses or caps


def _drop_refusals(VllmConfig, unsupported, validate, ours) -> None:
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
            raise ValueError(
                "Adaptive verification is not currently compatible with pipeline parallelism"
            )

    setattr(v1_unsupported, _MARK, True)
    VllmConfig._get_v1_model_runner_unsupported_features = v1_unsupported
    VllmConfig._validate_adaptive_verification = validate_adaptive_verification


def runs_plugin_dspark_on_v1(config) -> bool:
    """Whether the plugin's runner (worker/dspark_runner.py) drafts for `config`:
    V4.1's DSpark stages on vLLM's V1 runner, on the CPU."""
    from vllm.platforms import current_platform

    return (
        current_platform.is_cpu() and uses_dspark_stages(config) and not config.use_v2_model_runner
    )


def _keep_active_requests(VllmConfig, reserve, ours) -> None:
    @functools.wraps(reserve)
    def set_max_num_scheduled_tokens(self) -> None:
        asked = self.scheduler_config.max_num_active_seqs
        reserve(self)
        capped = self.scheduler_config.max_num_active_seqs
        if capped != asked and ours(self) and runs_plugin_dspark_on_v1(self):
            logger.info_once(
                "DSpark on the V1 runner drafts outside the step's token budget: "
                "max_num_active_seqs stays %s (vLLM lowered it to %d for Model Runner V2's "
                "draft pass)",
                asked if asked is not None else "unset",
                capped,
            )
            self.scheduler_config.max_num_active_seqs = asked

    setattr(set_max_num_scheduled_tokens, _MARK, True)
    VllmConfig._set_max_num_scheduled_tokens = set_max_num_scheduled_tokens
