"""Reading DeepSeek-native checkpoint tensors: quantized weights are paired with their
`.scale` siblings, whatever order the shards list them in, and either kept as stored
(where the model holds them in release precision) or decoded by the storage format the
release layout gives them; every tensor is checked against the layout."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import torch

from vllm_deepinfer.checkpoint.formats import FORMATS, scale_name
from vllm_deepinfer.checkpoint.layout import TensorSpec
from vllm_deepinfer.checkpoint.mx_formats import check_scale_bytes

_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8)


class CheckpointError(ValueError):
    """A tensor is missing, unexpected, mis-shaped or stored in the wrong format."""


class Stored(NamedTuple):
    """A quantized weight kept as the release stores it: values and UE8M0 scale bytes."""

    values: torch.Tensor
    scale: torch.Tensor


def _paired(
    name: str,
    values: torch.Tensor,
    scale: torch.Tensor,
    layout: dict[str, TensorSpec],
    keep: Callable[[str], bool],
) -> torch.Tensor | Stored:
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
    if keep(name):
        expected = spec.stored(name)
        for got, (file_name, (shape, _)) in zip((values, scale), expected.items()):
            if tuple(got.shape) != shape:
                raise CheckpointError(f"{file_name} has shape {tuple(got.shape)}, expected {shape}")
        try:
            return Stored(values, check_scale_bytes(scale))
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{scale_name(name)}: {e}") from e
    assert fmt.decode is not None, f"{fmt.name} is scaled, so it has a decoder"
    try:
        return fmt.decode(values, scale)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{name}: {e}") from e


def paired(
    weights: Iterable[tuple[str, torch.Tensor]],
    release_layout: dict[str, TensorSpec],
    keep: Callable[[str], bool] = lambda name: False,
) -> Iterator[tuple[str, torch.Tensor | Stored]]:
    """Yields (name, tensor) with each `.scale` paired with its weight: kept as `Stored`
    where `keep(name)` says the model holds it quantized, otherwise decoded to a float
    tensor; `release_layout` (quantized=True) says how each scaled weight is encoded."""
    waiting_weights: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(".scale"):
            weight_name = name[: -len(".scale")] + ".weight"
            if weight_name in waiting_weights:
                values = waiting_weights.pop(weight_name)
                yield weight_name, _paired(weight_name, values, tensor, release_layout, keep)
            else:
                waiting_scales[weight_name] = tensor
        elif tensor.dtype in _QUANTIZED_DTYPES:
            if name in waiting_scales:
                scale = waiting_scales.pop(name)
                yield name, _paired(name, tensor, scale, release_layout, keep)
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
    weights: Iterable[tuple[str, torch.Tensor]],
    release_layout: dict[str, TensorSpec],
    keep: Callable[[str], bool] = lambda name: False,
) -> Iterator[tuple[str, torch.Tensor | Stored]]:
    """`paired` tensors, each one checked against the layout; raises on the first
    unexpected or mis-shaped tensor and, at the end, on any that never came."""
    seen = set()
    for name, tensor in paired(weights, release_layout, keep):
        spec = release_layout.get(name)
        if spec is None:
            raise CheckpointError(f"unexpected tensor {name} in the checkpoint")
        if not isinstance(tensor, Stored) and tuple(tensor.shape) != spec.shape:
            raise CheckpointError(f"{name} has shape {tuple(tensor.shape)}, expected {spec.shape}")
        seen.add(name)
        yield name, tensor
    missing = sorted(set(release_layout) - seen)
    if missing:
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} tensors: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
        )
