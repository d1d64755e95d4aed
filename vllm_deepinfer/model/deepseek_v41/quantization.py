"""The release checkpoint's precision, kept in memory through vLLM's quantization machinery.

The V4.1 release marks its weights `quant_method: fp8` with 32x32 blocks and
`expert_dtype: fp4`, which vLLM routes to upstream's DeepSeek V4 method (GPU kernels that
refuse fp32 activations). The plugin claims that config for its own model instead:

- `deepinfer_mx` (the default for a release checkpoint): MXFP8 linears keep their e4m3
  values and 32x32 block scales (`Mxfp8LinearMethod`), MXFP4 experts their packed nibbles
  and per-32 scales (`Mxfp4ExpertsMethod`). Both multiply through `mx_linear`, which
  dequantizes one tile of output rows at a time (kernels/mx_matmul.py). vLLM's own CPU
  kernels do not fit these weights: its FP8 W8A16 GEMM (`fp8_scaled_mm_cpu`, AMX) takes
  K blocks of 128 only (the release's are 32), and its MXFP4 experts (`CPUExpertsMxfp4`,
  AMX) apply SiLU or gpt-oss's SwiGLU, not V4.1's clamped SwiGLU.
- `deepinfer_dequantized` (`--quantization deepinfer_dequantized`): the old load, every
  quantized weight widened to the model dtype while loading (about 4x the memory of the
  experts as released); chosen explicitly only, and logged.

UE8M0 scales are held as uint8 bytes (collectives and `copy_` move them as bytes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.utils import set_weight_attrs

from vllm_deepinfer.checkpoint.mx_formats import BLOCK
from vllm_deepinfer.determinism import batch_invariant
from vllm_deepinfer.kernels import weight_gemv
from vllm_deepinfer.kernels.mx_matmul import mx_linear as mx_product
from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.model.deepseek_v41.layer_ops import register_function

logger = init_logger(__name__)

NAME = "deepinfer_mx"
DEQUANTIZED_NAME = "deepinfer_dequantized"
V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")


def is_release_mx_format(hf_quant_cfg: Any) -> bool:
    return (
        isinstance(hf_quant_cfg, dict)
        and hf_quant_cfg.get("quant_method") in ("fp8", "deepseek_v4_fp8")
        and list(hf_quant_cfg.get("weight_block_size") or []) == [32, 32]
        and hf_quant_cfg.get("expert_dtype", "fp4") == "fp4"
    )


def _mx_linear(
    x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, mxfp4: bool
) -> torch.Tensor:
    product = batch_invariant.linear if batch_invariant.enabled() else None
    return mx_product(x, values, scale, mxfp4, product)


def _mx_linear_fake(
    x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, mxfp4: bool
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], values.shape[0])


mx_linear = register_function("mx_linear", _mx_linear, _mx_linear_fake)
"""x @ W.T for a weight stored as (values, UE8M0 bytes), MXFP4 or MXFP8."""


def check_blocks(what: str, **dims: int) -> None:
    for dim, size in dims.items():
        if size % BLOCK:
            raise ValueError(
                f"{what}: {dim} {size} (this rank's share) is not a multiple of the "
                f"release's {BLOCK}-value scale block; choose a parallel layout that "
                f"splits it in whole blocks, or --quantization {DEQUANTIZED_NAME}"
            )


def _parameter(shape: tuple[int, ...], dtype: torch.dtype, **attrs) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(param, attrs)
    return param


class Mxfp8LinearMethod(LinearMethodBase):
    """A linear layer's weight as released: e4m3 `weight` [O, K] and UE8M0 `weight_scale`
    [O/32, K/32] (this rank's rows or columns under tensor parallelism, split by vLLM's
    own weight loaders along the same dims)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        out_features = sum(output_partition_sizes)
        check_blocks(
            f"MXFP8 layer {getattr(layer, 'prefix', '')}",
            rows=out_features,
            columns=input_size_per_partition,
        )
        attrs = {"input_dim": 1, "output_dim": 0, **extra_weight_attrs}
        layer.register_parameter(
            "weight",
            _parameter((out_features, input_size_per_partition), torch.float8_e4m3fn, **attrs),
        )
        layer.register_parameter(
            "weight_scale",
            _parameter(
                (out_features // BLOCK, input_size_per_partition // BLOCK), torch.uint8, **attrs
            ),
        )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = mx_linear(x, layer.weight, layer.weight_scale, False)
        return out if bias is None else out + bias


class RoutedExpertsMethod(QuantizeMethodBase):
    """The routed experts as the model dtype holds them: `w13` [E, 2I, H] (w1 rows, then
    w3) and `w2` [E, H, I], read in place one expert at a time."""

    quantized = False

    @property
    def stacked_product(self) -> bool:
        """Whether one batched product over the whole stack may run every expert at once
        (dense weights in the model dtype, read in place; not in batch-invariant mode,
        whose products run on fixed tiles)."""
        return not batch_invariant.enabled()

    def create_weights(
        self, layer: nn.Module, experts: int, inter: int, hidden: int, params_dtype: torch.dtype
    ) -> None:
        layer.register_parameter("w13", _parameter((experts, 2 * inter, hidden), params_dtype))
        layer.register_parameter("w2", _parameter((experts, hidden, inter), params_dtype))

    def stored(self, layer: nn.Module) -> tuple[torch.Tensor, ...]:
        """What EPLB moves between ranks, local physical experts first."""
        return layer.w13, layer.w2

    def load(
        self,
        layer: nn.Module,
        slot: int,
        which: str,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
        rank: int,
    ) -> None:
        """Copies this rank's share of checkpoint tensor `which` (w1, w3, w2) into `slot`."""
        i = layer.w2.shape[2]
        if which == "w2":
            layer.w2.data[slot].copy_(weight[:, rank * i : (rank + 1) * i])
        else:
            rows = slice(0, i) if which == "w1" else slice(i, 2 * i)
            layer.w13.data[slot, rows].copy_(weight[rank * i : (rank + 1) * i])

    def kernel_stacks(self, layer: nn.Module):
        """(format, w13, w2) as the fused experts kernel (kernels/weight_gemv.py) reads
        them, each (values, scales or None); None where it has no format for them."""
        format = weight_gemv.DENSE_FORMATS.get(layer.w13.dtype)
        return None if format is None else (format, (layer.w13, None), (layer.w2, None))

    def apply(self, layer: nn.Module, x: torch.Tensor, which: str, expert: int) -> torch.Tensor:
        """x @ W.T for local expert `expert`'s `which` (w13 or w2)."""
        weight = getattr(layer, which)[expert]
        if batch_invariant.enabled():
            return batch_invariant.linear(x, weight)
        return F.linear(x, weight.to(x.dtype))


class Mxfp4ExpertsMethod(RoutedExpertsMethod):
    """The routed experts as released: `w13` [E, 2I, H/2] and `w2` [E, H, I/2] packed
    e2m1 nibbles (int8), `w13_scale` [E, 2I, H/32] and `w2_scale` [E, H, I/32] UE8M0
    bytes. EPLB moves values and scales together, as stored."""

    quantized = True
    stacked_product = False

    def create_weights(
        self, layer: nn.Module, experts: int, inter: int, hidden: int, params_dtype: torch.dtype
    ) -> None:
        check_blocks("MXFP4 experts", moe_intermediate_size=inter, hidden_size=hidden)
        layer.register_parameter("w13", _parameter((experts, 2 * inter, hidden // 2), torch.int8))
        layer.register_parameter(
            "w13_scale", _parameter((experts, 2 * inter, hidden // BLOCK), torch.uint8)
        )
        layer.register_parameter("w2", _parameter((experts, hidden, inter // 2), torch.int8))
        layer.register_parameter(
            "w2_scale", _parameter((experts, hidden, inter // BLOCK), torch.uint8)
        )

    def stored(self, layer: nn.Module) -> tuple[torch.Tensor, ...]:
        return layer.w13, layer.w13_scale, layer.w2, layer.w2_scale

    def load(self, layer, slot, which, weight, scale, rank) -> None:
        if scale is None:
            raise ValueError(f"MXFP4 expert tensor {which} came without its .scale")
        i = layer.w2_scale.shape[2] * BLOCK
        scale = scale.view(torch.uint8)
        if which == "w2":
            layer.w2.data[slot].copy_(weight[:, rank * i // 2 : (rank + 1) * i // 2])
            cols = slice(rank * i // BLOCK, (rank + 1) * i // BLOCK)
            layer.w2_scale.data[slot].copy_(scale[:, cols])
        else:
            rows = slice(0, i) if which == "w1" else slice(i, 2 * i)
            mine = slice(rank * i, (rank + 1) * i)
            layer.w13.data[slot, rows].copy_(weight[mine])
            layer.w13_scale.data[slot, rows].copy_(scale[mine])

    def kernel_stacks(self, layer: nn.Module):
        return weight_gemv.MXFP4, (layer.w13, layer.w13_scale), (layer.w2, layer.w2_scale)

    def apply(self, layer, x, which, expert) -> torch.Tensor:
        values = getattr(layer, which)[expert]
        return mx_linear(x, values, getattr(layer, f"{which}_scale")[expert], True)


class ReleaseMxConfig(QuantizationConfig):
    """`deepinfer_mx`: the release's MXFP8 linears and MXFP4 experts stay as stored."""

    NAME = NAME

    def get_name(self) -> str:
        return self.NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ReleaseMxConfig:
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """Layers the model builds with this config are those the release quantizes."""
        if isinstance(layer, LinearBase):
            return Mxfp8LinearMethod()
        return None

    def experts_method(self) -> RoutedExpertsMethod:
        return Mxfp4ExpertsMethod()

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        model_type = getattr(hf_config, "model_type", None)
        if not is_release_mx_format(hf_quant_cfg):
            return None
        if model_type in V41_MODEL_TYPES and user_quant in (None, cls.NAME):
            return cls.NAME
        # vLLM's draft config for DSpark (same checkpoint, typed `deepseek_mtp` while it
        # is built) inherits the target's method: the plugin's, where it claimed the target.
        if model_type == "deepseek_mtp" and user_quant == cls.NAME:
            return cls.NAME
        return None


class DequantizedConfig(ReleaseMxConfig):
    """`deepinfer_dequantized`: every quantized weight widened to the model dtype while
    loading; only when asked for by name."""

    NAME = DEQUANTIZED_NAME

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        return None

    def experts_method(self) -> RoutedExpertsMethod:
        return RoutedExpertsMethod()

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        if user_quant == cls.NAME and is_release_mx_format(hf_quant_cfg):
            return cls.NAME
        return None


def keeps_release_precision(quant_config: QuantizationConfig | None) -> bool:
    """Whether the engine holds the release's quantized weights as stored."""
    return isinstance(quant_config, ReleaseMxConfig) and not isinstance(
        quant_config, DequantizedConfig
    )


def experts_method(quant_config: QuantizationConfig | None) -> RoutedExpertsMethod:
    """The routed experts' storage under the engine's quantization config."""
    if isinstance(quant_config, ReleaseMxConfig):
        return quant_config.experts_method()
    return RoutedExpertsMethod()


def log_precision(quant_config: QuantizationConfig | None, dtype: torch.dtype) -> None:
    if isinstance(quant_config, DequantizedConfig):
        logger.info_once(
            "--quantization %s: the release's MXFP8 linears and MXFP4 experts are "
            "dequantized to %s while loading (about 4x the experts' memory as released)",
            DEQUANTIZED_NAME,
            dtype,
        )
    elif isinstance(quant_config, ReleaseMxConfig):
        logger.info_once(
            "Release precision kept in memory: MXFP8 linears, MXFP4 experts (multiplied "
            "one dequantized tile at a time); Engram tables mapped from the checkpoint"
        )


def register() -> None:
    register_quantization_config(NAME)(ReleaseMxConfig)
    register_quantization_config(DEQUANTIZED_NAME)(DequantizedConfig)
