"""What one forward step of the paged model carries from layer to layer: where every
token sits (its request, its context length), the requests laid out as padded groups
for the parts that score a whole context (the indexer), the kv-source layers, and what
later layers reuse (each index source's top-k, the candidate blocks, Engram's table
rows, where image tokens sit). Everything is tensors on the step's device, built once."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_deepinfer.kv_cache.paged import PagedStepMetadata


@dataclass
class RequestGroup:
    """Requests padded to one query length: `tokens` [R, Q] holds each request's token
    indices in the step (-1 past its chunk). Single-token rows (decodes) and longer
    chunks (prefills) form separate groups, so a long chunk does not pad every decode."""
    requests: torch.Tensor  # [R] request index in the step
    tokens: torch.Tensor  # [R, Q] token index, -1 = padding
    seq_lens: torch.Tensor  # [R] context length after this step

    @property
    def present(self) -> torch.Tensor:
        return self.tokens >= 0


@dataclass
class StepBatch:
    """The requests of one forward step, per token and as padded groups."""
    num_tokens: int
    request_of_token: torch.Tensor  # [T]
    groups: list[RequestGroup]

    @classmethod
    def from_metadata(cls, md: PagedStepMetadata | None,
                      device: torch.device) -> "StepBatch | None":
        if md is None:
            return None
        starts = torch.tensor(md.query_start_loc, dtype=torch.int64)
        lengths = starts[1:] - starts[:-1]
        seq_lens = torch.tensor(md.seq_lens, dtype=torch.int64)
        request_of_token = torch.repeat_interleave(torch.arange(md.num_reqs), lengths)
        groups = []
        for members in ((lengths == 1).nonzero().flatten(), (lengths > 1).nonzero().flatten()):
            if members.numel() == 0:
                continue
            width = int(lengths[members].max())
            offsets = torch.arange(width)[None, :]
            tokens = torch.where(offsets < lengths[members][:, None],
                                 starts[members][:, None] + offsets, -1)
            groups.append(RequestGroup(members.to(device), tokens.to(device),
                                       seq_lens[members].to(device)))
        return cls(md.num_actual_tokens, request_of_token.to(device), groups)


@dataclass
class TopK:
    """Each token's chosen compressed groups: indices [T, k] and which of them count."""
    groups: torch.Tensor
    valid: torch.Tensor


@dataclass
class StepContext:
    positions: torch.Tensor
    batch: StepBatch | None  # None in profile/dummy runs: no caches are bound
    sources: dict = field(default_factory=dict)  # kv-source layer -> its V41Attention
    selection: dict[int, TopK] = field(default_factory=dict)
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)  # group -> [R*Q, G]
    engram_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    image_tokens: torch.Tensor | None = None  # bool [T]: dead to Engram
    vision_routed: torch.Tensor | None = None  # bool [T]: MoE selects with bias_vl
