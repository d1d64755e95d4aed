"""What one forward step of the paged model carries from layer to layer: where every
token sits (its request, its context length), the requests laid out as padded groups
for the parts that score a whole context (the indexer), the kv-source layers, and what
later layers reuse (each index source's top-k, the candidate blocks, Engram's table
rows, where image tokens sit). Everything is tensors on the step's device, built once.

The compiled graph carries none of it (vLLM traces the model once, without metadata): the
layers' opaque ops (layer_ops.py) get it from their `StepScope`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_deepinfer.kv_cache.paged import PagedCache, PagedStepMetadata


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
    """The requests of one forward step, per token and as padded groups, with where each
    request's recomputation starts (kv_cache/bounded_replay.py): window keys before
    `replay_start` are not attended, and layers after the last kv source attend nothing
    before `kept_from`."""

    num_tokens: int
    request_of_token: torch.Tensor  # [T]
    groups: list[RequestGroup]
    seq_lens: torch.Tensor  # [R] on the CPU: what a subset's groups are built from
    replay_start: torch.Tensor  # [R]
    kept_from: torch.Tensor  # [R]

    @classmethod
    def from_metadata(cls, md: PagedStepMetadata | None, device: torch.device) -> StepBatch | None:
        if md is None:
            return None
        seq_lens = torch.tensor(md.seq_lens, dtype=torch.int64)
        requests = len(md.seq_lens)
        if requests and md.query_start_loc == list(range(requests + 1)):  # one token each
            order = torch.arange(requests, device=device)
            group = RequestGroup(order, order[:, None], seq_lens.to(device))
            return cls(
                requests,
                order,
                [group],
                seq_lens,
                md.replay_start.to(device),
                md.kept_from.to(device),
            )
        starts = torch.tensor(md.query_start_loc, dtype=torch.int64)
        return cls.from_layout(
            starts[1:] - starts[:-1], seq_lens, md.replay_start, md.kept_from, device
        )

    @classmethod
    def from_layout(
        cls,
        lengths: torch.Tensor,
        seq_lens: torch.Tensor,
        replay_start: torch.Tensor,
        kept_from: torch.Tensor,
        device: torch.device,
    ) -> StepBatch:
        """From each request's query length and context length (CPU tensors)."""
        starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        request_of_token = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        groups = []
        for members in ((lengths == 1).nonzero().flatten(), (lengths > 1).nonzero().flatten()):
            if members.numel() == 0:
                continue
            width = int(lengths[members].max())
            offsets = torch.arange(width)[None, :]
            tokens = torch.where(
                offsets < lengths[members][:, None], starts[members][:, None] + offsets, -1
            )
            groups.append(
                RequestGroup(members.to(device), tokens.to(device), seq_lens[members].to(device))
            )
        return cls(
            int(lengths.sum()),
            request_of_token.to(device),
            groups,
            seq_lens,
            replay_start.to(device),
            kept_from.to(device),
        )

    def kept(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Decoder-side replay: indices of the tokens at or after their request's
        `kept_from`, or None when every token is kept."""
        keep = positions >= self.kept_from[self.request_of_token]
        return None if bool(keep.all()) else keep.nonzero().flatten()

    def subset(self, tokens: torch.Tensor) -> StepBatch:
        """The same requests with only `tokens` (a suffix of each request's chunk)."""
        lengths = torch.bincount(self.request_of_token[tokens].cpu(), minlength=len(self.seq_lens))
        return StepBatch.from_layout(
            lengths, self.seq_lens, self.replay_start, self.kept_from, self.request_of_token.device
        )


@dataclass
class DraftBlock:
    """One DSpark draft step: B requests, each a block of N positions from its anchor P
    (one past its last accepted token). `requests` index the rows of the last step's
    cache metadata; context keys before `first_key` (a replay start) were not written."""

    positions: torch.Tensor  # [B, N]
    requests: torch.Tensor  # [B]
    first_key: torch.Tensor  # [B]


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
    rows: torch.Tensor | None = None  # the step's tokens these are (None: all of them)
    kv_written: frozenset[int] = frozenset()  # layers whose KV every row already stored

    def slots(self, md: PagedStepMetadata) -> torch.Tensor:
        """The cache slots of this context's tokens."""
        return md.slot_mapping if self.rows is None else md.slot_mapping[self.rows]

    def kept(self, tokens: torch.Tensor, written_by: int) -> StepContext:
        """Decoder-side replay: the context of `tokens` only, after layer `written_by`
        stored its KV for every row. Top-k choices are kept per token; candidate blocks
        and Engram rows are not needed after the cut (decoder_replay_cut)."""
        pick = lambda t: None if t is None else t[tokens]  # noqa: E731
        return StepContext(
            self.positions[tokens],
            self.batch.subset(tokens),
            self.sources,
            selection={
                k: TopK(t.groups[tokens], t.valid[tokens]) for k, t in self.selection.items()
            },
            image_tokens=pick(self.image_tokens),
            vision_routed=pick(self.vision_routed),
            rows=tokens,
            kv_written=frozenset({written_by}),
        )


class StepScope:
    """The step's context as the layer ops see it, shared by the model's layers: built
    from the forward context's metadata by the step's first op (the ops of one step run in
    layer order, each depending on the one before), handed to the later ones, and with
    decoder-side replay trimmed once, at the cut layer.

    A step is recognised by its window metadata object, which the builder makes anew for
    every step (the scope holds it, so its identity cannot be reused while compared)."""

    def __init__(self, window: PagedCache, sources: dict, cut: int | None):
        self.window, self.sources, self.cut = window, sources, cut
        self._metadata: PagedStepMetadata | None = None
        self._context: StepContext | None = None
        self._trimmed: tuple[StepContext, torch.Tensor] | None = None

    def context(self, positions: torch.Tensor | None) -> StepContext:
        """This step's context over its real tokens (the runner's padding rows cut off);
        without metadata (profile and dummy runs) a context with no batch. `positions`
        (the step's) may be None after the step's first op."""
        md = self.window.metadata()
        if md is None:
            return StepContext(positions, None, sources=self.sources)
        if md is not self._metadata or self._context is None:
            if positions is None:
                raise RuntimeError("a V4.1 layer op ran before the step's first op")
            step = StepBatch.from_metadata(md, positions.device)
            self._metadata, self._trimmed = md, None
            self._context = StepContext(positions[: step.num_tokens], step, sources=self.sources)
        return self._context

    def trim(self) -> bool:
        """Decoder-side replay, at the cut layer: whether the step keeps only some rows
        from here on (`rows`); if so, the cut layer stores KV for every row first."""
        kept = self._context.batch.kept(self._context.positions)
        self._trimmed = None if kept is None else (self._context.kept(kept, self.cut), kept)
        return kept is not None

    def rows(self, layer: int, positions: torch.Tensor | None):
        """(context, rows) a layer computes: rows index the step's real tokens, None for
        all of them; after the cut, the kept rows of a trimmed step."""
        ctx = self.context(positions)
        if (
            ctx.batch is not None
            and self._trimmed is not None
            and self.cut is not None
            and layer >= self.cut
        ):
            return self._trimmed
        return ctx, None
