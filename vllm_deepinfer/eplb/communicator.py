"""Moving expert weights between CPU ranks for vLLM's EPLB rearrangement.

vLLM's gloo communicator stages tensors through host memory and synchronises the current
accelerator stream, which does not exist on the CPU (`torch.accelerator` raises there).
Here the tensors already live in host memory: each transfer is a gloo send or receive
on the EP group's CPU process group, all posted together and awaited."""

from __future__ import annotations

import torch
import torch.distributed as dist
from vllm.distributed.eplb.eplb_communicator import EplbCommunicator


class CpuGlooEplbCommunicator(EplbCommunicator):
    def __init__(self, cpu_group: dist.ProcessGroup):
        self._group = cpu_group
        self._stream = None
        self._ops: list[dist.P2POp] = []
        self._log_initialized()

    def add_send(self, tensors: list[torch.Tensor], dst_rank: int, expert_id: int) -> None:
        self._ops += [
            dist.P2POp(dist.isend, t.contiguous(), group=self._group, group_peer=dst_rank)
            for t in tensors
        ]

    def add_recv(self, tensors: list[torch.Tensor], src_rank: int, expert_id: int) -> None:
        for tensor in tensors:
            if not tensor.is_contiguous():
                raise ValueError("EPLB receives into contiguous expert buffers only")
            self._ops.append(dist.P2POp(dist.irecv, tensor, group=self._group, group_peer=src_rank))

    def execute(self) -> None:
        ops, self._ops = self._ops, []
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
