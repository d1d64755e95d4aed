"""How V4.1 splits across vLLM's process groups, in one place.

Tensor parallelism (`--tensor-parallel-size`): attention heads, their sinks and the
`o_groups` of the grouped output split across ranks (`wq_b` column-parallel, `wo_b`
row-parallel); the shared expert and, without expert parallelism, every routed expert
split along the intermediate width. Both MoE halves leave partial sums, reduced once.
The latent caches, the indexer, the compressors, Engram and the hyper-connections are
whole on every rank (one 512-wide latent serves all heads).

Expert parallelism (`--enable-expert-parallel`): the routed experts are spread over
vLLM's EP group (its TP x DP ranks), each rank holding `local_experts` physical experts
(with EPLB, `num_redundant_experts` of them copies); tokens are all-gathered across the
data-parallel ranks before the routed experts and their outputs reduce-scattered back,
through the EP group's all-to-all manager."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.config import VllmConfig
from vllm.distributed import (
    get_ep_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


@dataclass(frozen=True)
class TensorSplit:
    """This rank's share of tensor-parallel dimensions."""

    size: int
    rank: int

    @classmethod
    def current(cls) -> TensorSplit:
        return cls(get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank())

    def part(self, total: int, what: str) -> int:
        """`total` / size, refusing a dimension that does not split evenly."""
        if total % self.size:
            raise ValueError(
                f"{what} ({total}) does not split over tensor_parallel_size={self.size}"
            )
        return total // self.size

    def loader(self, dim: int):
        """A weight loader that copies this rank's contiguous slice of the checkpoint
        tensor along `dim`."""

        def load(param: torch.Tensor, loaded: torch.Tensor) -> None:
            width = param.shape[dim]
            param.data.copy_(loaded.narrow(dim, self.rank * width, width))

        return load


@dataclass(frozen=True)
class ExpertPlacement:
    """Where one MoE layer's routed experts live. `physical` experts (the logical ones
    plus EPLB's redundant copies) are split evenly over `ranks` expert-parallel ranks in
    order: this rank holds physical experts [first, first + local). Without expert
    parallelism every rank holds all experts, each split along the intermediate width by
    `width`."""

    logical: int
    physical: int
    ranks: int
    rank: int
    width: TensorSplit

    @classmethod
    def of(cls, vllm_config: VllmConfig, logical: int, balanced: bool) -> ExpertPlacement:
        """`balanced`: the layer takes part in EPLB (gets its redundant experts)."""
        parallel = vllm_config.parallel_config
        if not parallel.enable_expert_parallel:
            return cls.whole(logical)
        group = get_ep_group()
        redundant = (
            parallel.eplb_config.num_redundant_experts if (balanced and parallel.enable_eplb) else 0
        )
        if (logical + redundant) % group.world_size:
            raise ValueError(
                f"{logical} experts + {redundant} redundant do not split over "
                f"{group.world_size} expert-parallel ranks"
            )
        return cls(
            logical, logical + redundant, group.world_size, group.rank_in_group, TensorSplit(1, 0)
        )

    @classmethod
    def whole(cls, logical: int) -> ExpertPlacement:
        """Every expert on every rank, split along its width under tensor parallelism
        (the DSpark stages: their small MoE stays out of expert parallelism and EPLB)."""
        return cls(logical, logical, 1, 0, TensorSplit.current())

    @property
    def local(self) -> int:
        return self.physical // self.ranks

    @property
    def first(self) -> int:
        return self.rank * self.local

    @property
    def sharded(self) -> bool:
        """Experts are spread over ranks (each token's experts may live elsewhere)."""
        return self.ranks > 1

    def initial_logical(self) -> list[int]:
        """The logical expert of each local slot before any rearrangement (vLLM's initial
        map: the logical experts in order, then copies of 0, 1, ...)."""
        return [slot % self.logical for slot in range(self.first, self.first + self.local)]
