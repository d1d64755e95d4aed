"""What one forward step of the paged model carries from layer to layer: the requests'
token ranges, the kv-source layers, and what later layers reuse (each index source's
top-k, the candidate blocks, Engram's table rows, where image tokens sit)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_deepinfer.kv_cache.paged import PagedStepMetadata


@dataclass
class StepBatch:
    """The requests of one forward step: token ranges and context lengths."""
    query_start: list[int]
    seq_lens: list[int]
    num_tokens: int

    @classmethod
    def from_metadata(cls, md: PagedStepMetadata | None) -> "StepBatch | None":
        if md is None:
            return None
        return cls(md.query_start_loc, md.seq_lens, md.num_actual_tokens)

    def requests(self):
        """(request index, token slice, first position of the chunk, context length)."""
        for r, length in enumerate(self.seq_lens):
            qs, qe = self.query_start[r], self.query_start[r + 1]
            if qe > qs:
                yield r, slice(qs, qe), length - (qe - qs), length


@dataclass
class StepContext:
    positions: torch.Tensor
    batch: StepBatch | None  # None in profile/dummy runs: no caches are bound
    sources: dict = field(default_factory=dict)  # kv-source layer -> its V41Attention
    selection: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)
    engram_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    image_tokens: torch.Tensor | None = None  # bool [T]: dead to Engram
    vision_routed: torch.Tensor | None = None  # bool [T]: MoE selects with bias_vl
