"""Reading DeepSeek-native checkpoint tensors: quantized weights are paired with their
`.scale` siblings, whatever order the shards list them in, and decoded by the storage
format the release layout gives them; every tensor is checked against the layout."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from vllm_deepinfer.checkpoint.formats import FORMATS
from vllm_deepinfer.checkpoint.layout import TensorSpec

_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8)


class CheckpointError(ValueError):
    """A tensor is missing, unexpected, mis-shaped or stored in the wrong format."""


def _decode(
    name: str, values: torch.Tensor, scale: torch.Tensor, layout: dict[str, TensorSpec]
) -> torch.Tensor:
    spec = layout.get(name)
    if spec is None:
        raise CheckpointError(f"unexpected tensor {name} in the checkpoint")
    fmt = FORMATS[spec.fmt]
    if not fmt.scaled:
        raise CheckpointError(f"{name} carries a .scale, but the release stores it as {fmt.name}")
    if values.dtype != fmt.values_dtype:
        raise CheckpointError(
            f"{name}: {fmt.name.upper()} values must be {fmt.values_dtype}, got {values.dtype}"
        )
    assert fmt.decode is not None, f"{fmt.name} is scaled, so it has a decoder"
    try:
        return fmt.decode(values, scale)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{name}: {e}") from e


def dequantized(
    weights: Iterable[tuple[str, torch.Tensor]], release_layout: dict[str, TensorSpec]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, float tensor) with `.scale` tensors folded into their weights;
    `release_layout` (quantized=True) says how each scaled weight is encoded."""
    waiting_weights: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(".scale"):
            weight_name = name[: -len(".scale")] + ".weight"
            if weight_name in waiting_weights:
                yield (
                    weight_name,
                    _decode(weight_name, waiting_weights.pop(weight_name), tensor, release_layout),
                )
            else:
                waiting_scales[weight_name] = tensor
        elif tensor.dtype in _QUANTIZED_DTYPES:
            if name in waiting_scales:
                yield name, _decode(name, tensor, waiting_scales.pop(name), release_layout)
            else:
                waiting_weights[name] = tensor
        else:
            yield name, tensor
    if waiting_weights:
        raise CheckpointError(f"quantized tensors without a .scale: {sorted(waiting_weights)}")
    if waiting_scales:
        names = sorted(n[: -len(".weight")] + ".scale" for n in waiting_scales)
        raise CheckpointError(f".scale tensors without their weight: {names}")


def checked(
    weights: Iterable[tuple[str, torch.Tensor]], release_layout: dict[str, TensorSpec]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized tensors, each one checked against the layout; raises on the first
    unexpected or mis-shaped tensor and, at the end, on any that never came."""
    seen = set()
    for name, tensor in dequantized(weights, release_layout):
        spec = release_layout.get(name)
        if spec is None:
            raise CheckpointError(f"unexpected tensor {name} in the checkpoint")
        if tuple(tensor.shape) != spec.shape:
            raise CheckpointError(f"{name} has shape {tuple(tensor.shape)}, expected {spec.shape}")
        seen.add(name)
        yield name, tensor
    missing = sorted(set(release_layout) - seen)
    if missing:
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} tensors: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
        )
