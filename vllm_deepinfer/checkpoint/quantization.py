"""Claims the release checkpoint's `quantization_config` for the plugin's model.

The V4.1 release marks its MXFP8/MXFP4 weights with `quant_method: fp8` and 32x32 blocks,
which vLLM routes to upstream's DeepSeek V4 FP8 method: GPU kernels that also refuse
fp32 activations. The plugin's model dequantizes while loading instead (see
loader.py), so its layers take no vLLM quantization method at all.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

NAME = "deepinfer_mx"
V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")


def is_release_mx_format(hf_quant_cfg: Any) -> bool:
    return (
        isinstance(hf_quant_cfg, dict)
        and hf_quant_cfg.get("quant_method") in ("fp8", "deepseek_v4_fp8")
        and list(hf_quant_cfg.get("weight_block_size") or []) == [32, 32]
        and hf_quant_cfg.get("expert_dtype", "fp4") == "fp4"
    )


class DequantizedOnLoad(QuantizationConfig):
    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DequantizedOnLoad:
        return cls()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        return None

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        model_type = getattr(hf_config, "model_type", None)
        if not is_release_mx_format(hf_quant_cfg):
            return None
        if model_type in V41_MODEL_TYPES and user_quant in (None, NAME):
            return NAME
        # vLLM's draft config for DSpark (same checkpoint, typed `deepseek_mtp` while it
        # is built) inherits the target's method: the plugin's, where it claimed the target.
        if model_type == "deepseek_mtp" and user_quant == NAME:
            return NAME
        return None


def register() -> None:
    register_quantization_config(NAME)(DequantizedOnLoad)
