"""The MoE layer's side of vLLM's EPLB: routing a token's logical experts to physical
replicas and recording each physical expert's load, on every platform (vLLM does both in
a Triton kernel and skips them elsewhere)."""

from __future__ import annotations

import torch
from vllm.distributed.eplb.eplb_state import EplbLayerState


class ExpertLoadBalancing:
    """A layer's view of vLLM's EPLB state (`EplbLayerState`, which vLLM's EPLB state fills
    and keeps current through rearrangements). Until vLLM hands it over (EPLB off), a
    logical expert is its own physical expert and nothing is recorded."""

    def __init__(self):
        self.state = EplbLayerState()

    @property
    def active(self) -> bool:
        return self.state.logical_to_physical_map is not None

    def physical(self, logical: torch.Tensor) -> torch.Tensor:
        """Physical expert ids [T, k] for logical ids [T, k]: a token's replica is picked
        by its index among the step's tokens, spreading each expert's tokens evenly over
        its copies. Records the load while vLLM asks for it."""
        state = self.state
        if not self.active:
            return logical
        count = state.logical_replica_count[logical]
        replica = torch.arange(logical.shape[0], device=logical.device)[:, None] % count
        physical = state.logical_to_physical_map[logical, replica]
        if state.should_record_tensor is None or bool(state.should_record_tensor):
            state.expert_load_view.index_add_(
                0,
                physical.flatten(),
                torch.ones(
                    physical.numel(), dtype=state.expert_load_view.dtype, device=physical.device
                ),
            )
        return physical
