"""Reading DeepSeek-native checkpoint tensors: quantized weights are paired with their
`.scale` siblings and dequantized, whatever order the shards list them in."""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

from vllm_deepinfer.model import mx_formats
from vllm_deepinfer.model.layout import TensorSpec

_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
_ENGRAM_TABLE = re.compile(r"\.engram\.embed\.weight$")
_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8)


class CheckpointError(ValueError):
    """A tensor is missing, unexpected, mis-shaped or stored in the wrong format."""


def _dequantize(name: str, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    try:
        if _EXPERT.search(name):
            if values.dtype != torch.int8:
                raise CheckpointError(f"{name}: MXFP4 expert must be int8-packed, got {values.dtype}")
            return mx_formats.dequantize_mxfp4(values, scale)
        if _ENGRAM_TABLE.search(name):
            return mx_formats.dequantize_rowwise_fp8(values, scale)
        if values.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{name}: MXFP8 weight must be float8_e4m3fn, got {values.dtype}")
        return mx_formats.dequantize_mxfp8(values, scale)
    except (ValueError, TypeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{name}: {e}") from e


def dequantized(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, float tensor) with `.scale` tensors folded into their weights."""
    waiting_weights: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(".scale"):
            weight_name = name[: -len(".scale")] + ".weight"
            if weight_name in waiting_weights:
                yield weight_name, _dequantize(weight_name, waiting_weights.pop(weight_name), tensor)
            else:
                waiting_scales[weight_name] = tensor
        elif tensor.dtype in _QUANTIZED_DTYPES:
            if name in waiting_scales:
                yield name, _dequantize(name, tensor, waiting_scales.pop(name))
            else:
                waiting_weights[name] = tensor
        else:
            yield name, tensor
    if waiting_weights:
        raise CheckpointError(f"quantized tensors without a .scale: {sorted(waiting_weights)}")
    if waiting_scales:
        names = sorted(n[: -len('.weight')] + ".scale" for n in waiting_scales)
        raise CheckpointError(f".scale tensors without their weight: {names}")


def checked(weights: Iterable[tuple[str, torch.Tensor]],
            expected: dict[str, TensorSpec]) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized tensors, each one checked against the layout; raises on the first
    unexpected or mis-shaped tensor and, at the end, on any that never came."""
    seen = set()
    for name, tensor in dequantized(weights):
        spec = expected.get(name)
        if spec is None:
            raise CheckpointError(f"unexpected tensor {name} in the checkpoint")
        if tuple(tensor.shape) != spec.shape:
            raise CheckpointError(f"{name} has shape {tuple(tensor.shape)}, expected {spec.shape}")
        seen.add(name)
        yield name, tensor
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensors: "
                              f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
