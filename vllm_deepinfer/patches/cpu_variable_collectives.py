"""Variable-size all-gather and reduce-scatter on the CPU communicator, which vLLM's
all-gather/reduce-scatter all-to-all manager needs for expert parallelism across
data-parallel ranks.

Why: with `--data-parallel-size N --enable-expert-parallel` on the CPU, vLLM picks its
`AgRsAll2AllManager` (the CPU communicator's only all-to-all manager). Its dispatch
calls the group's `all_gatherv` and its combine `reduce_scatterv`, sized by each data-
parallel rank's token count; `CpuCommunicator` implements neither (the base class raises
NotImplementedError), so the first MoE step kills the engine. The patch gives the CPU
communicator both, built on the collectives it has: `all_gatherv` pads every rank's
part to the largest and all-gathers; `reduce_scatterv` all-reduces and keeps this rank's
rows (gloo has no reduce-scatter).

Upstream symbols: vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator
(all_gatherv, reduce_scatterv); written against vLLM 0.32.

Remove when: CpuCommunicator implements both (`apply()` then reports `not needed`)."""

from __future__ import annotations

import torch

from vllm_deepinfer.patches.base import PatchUnavailable

UPSTREAM = (
    "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator, "
    "vllm.distributed.device_communicators.base_device_communicator."
    "DeviceCommunicatorBase.all_gatherv"
)
_MARK = "_deepinfer_variable_collectives"


def _classes():
    try:
        from vllm.distributed.device_communicators import base_device_communicator, cpu_communicator
    except ImportError as exc:
        raise PatchUnavailable(f"vLLM's device communicators cannot be imported ({exc})") from exc
    cpu = getattr(cpu_communicator, "CpuCommunicator", None)
    base = getattr(base_device_communicator, "DeviceCommunicatorBase", None)
    if cpu is None:
        raise PatchUnavailable("vllm...cpu_communicator.CpuCommunicator is missing")
    if base is None or not hasattr(base, "all_gatherv") or not hasattr(base, "reduce_scatterv"):
        raise PatchUnavailable(
            "vllm...DeviceCommunicatorBase.all_gatherv / reduce_scatterv are missing"
        )
    for name in ("all_gather", "all_reduce"):
        if not callable(getattr(cpu, name, None)):
            raise PatchUnavailable(f"CpuCommunicator.{name} is missing")
    return cpu, base


def all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    """Every rank's `input_` (or each tensor of a list) concatenated along `dim`; rank r
    contributes `sizes[r]` entries (equal sizes when None)."""

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        d = dim % tensor.dim()
        if sizes is None or len(set(sizes)) == 1:
            return self.all_gather(tensor, d)
        largest = max(sizes)
        padded = tensor.new_zeros(*tensor.shape[:d], largest, *tensor.shape[d + 1 :])
        padded.narrow(d, 0, tensor.shape[d]).copy_(tensor)
        whole = self.all_gather(padded, d)
        return torch.cat(
            [whole.narrow(d, rank * largest, size) for rank, size in enumerate(sizes)], d
        )

    if isinstance(input_, (list, tuple)):
        return [gather(tensor) for tensor in input_]
    return gather(input_)


def reduce_scatterv(
    self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
) -> torch.Tensor:
    """The sum over ranks of `input_`, of which this rank keeps its `sizes[rank]`
    entries along `dim` (equal parts when None)."""
    d = dim % input_.dim()
    if sizes is None:
        sizes = [input_.shape[d] // self.world_size] * self.world_size
    total = self.all_reduce(input_.contiguous())
    start = sum(sizes[: self.rank_in_group])
    return total.narrow(d, start, sizes[self.rank_in_group]).contiguous()


def apply() -> bool:
    """Idempotent. True when the CPU communicator got the two collectives; False when it
    has its own."""
    cpu, base = _classes()
    if getattr(cpu.all_gatherv, _MARK, False):
        return True
    if cpu.all_gatherv is not base.all_gatherv or cpu.reduce_scatterv is not base.reduce_scatterv:
        return False
    for function in (all_gatherv, reduce_scatterv):
        setattr(function, _MARK, True)
        setattr(cpu, function.__name__, function)
    return True
