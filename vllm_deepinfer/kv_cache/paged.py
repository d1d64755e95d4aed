"""Paged caches owned by the V4.1 model, allocated and scheduled by vLLM's KV cache manager.

V4.1 keeps several caches per layer (the SWA latents, the compressed latents and index
keys of kv sources, the open compression group, Engram's token history). vLLM's own
attention layers know none of them, so each cache is a small `AttentionLayerBase` that
declares a built-in spec; the runner allocates it in its own KV-cache group and hands
us one metadata object per group. The model reads and writes rows by position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import KVCacheSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_deepinfer.kernels import sparse_attention
from vllm_deepinfer.kv_cache.bounded_replay import ReplayWindowSpec, tracker_for
from vllm_deepinfer.kv_cache.precision import RecordFormat


@dataclass
class PagedStepMetadata:
    """What one forward step needs to address a cache group, on the CPU."""

    slot_mapping: torch.Tensor  # [num_tokens] token slot = block * block_size + offset
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    block_size: int
    tokens_per_state: int
    seq_lens: list[int]  # context length of each request after this step
    query_start_loc: list[int]  # [num_reqs + 1]
    num_reqs: int
    num_actual_tokens: int
    replay_start: torch.Tensor  # [num_reqs] first recomputed position of a replayed hit, or 0
    kept_from: torch.Tensor  # [num_reqs] decoder-side replay: first row after the cut layer
    tokens_before_replay: torch.Tensor | None = None  # [num_reqs, lookback] ids, -1 = none


class PagedStepMetadataBuilder(AttentionMetadataBuilder[PagedStepMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Prefill and decode rows may be mixed in any order: attention is per request.
        self.reorder_batch_threshold = None
        self.replay = tracker_for(vllm_config)

    def build(
        self, common_prefix_len: int, cm: CommonAttentionMetadata, fast_build: bool = False
    ) -> PagedStepMetadata:
        n, r = cm.num_actual_tokens, cm.num_reqs
        spec = self.kv_cache_spec
        slot_mapping = cm.slot_mapping[:n].to(torch.int64)
        seq_lens = cm.seq_lens[:r].to(torch.int64)
        query_start_loc = cm.query_start_loc_cpu[: r + 1].to(torch.int64)
        replay = self.replay.view(r)
        start = kept_from = torch.zeros(r, dtype=torch.int64)
        lookback = None
        if replay is not None:
            start, kept_from = replay.start, replay.kept_from
            if not isinstance(spec, ReplayWindowSpec):
                slot_mapping = without_replayed_rows(
                    slot_mapping, query_start_loc, seq_lens.cpu(), start, self.replay.keep
                )
            if getattr(spec, "lookback_tokens", 0):
                lookback = self.replay.tokens_before(replay, spec.lookback_tokens)
        return PagedStepMetadata(
            slot_mapping=slot_mapping,
            block_table=cm.block_table_tensor[:r].to(torch.int64),
            block_size=spec.block_size,
            tokens_per_state=int(getattr(spec, "tokens_per_state", 1)),
            seq_lens=seq_lens.tolist(),
            query_start_loc=query_start_loc.tolist(),
            num_reqs=r,
            num_actual_tokens=n,
            replay_start=start,
            kept_from=kept_from,
            tokens_before_replay=lookback,
        )


def without_replayed_rows(
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    keep: int,
) -> torch.Tensor:
    """Replayed rows (positions in [s, s + keep) of a hit) only rebuild window caches:
    in a prefix-cached group they write nothing, because their rows sit in the hit's
    shared cached blocks (upstream pads them the same way)."""
    if not bool((start > 0).any()):
        return slot_mapping
    lengths = query_start_loc[1:] - query_start_loc[:-1]
    request = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    positions = (
        (seq_lens - lengths)[request] + torch.arange(len(request)) - query_start_loc[:-1][request]
    )
    s = start[request]
    replayed = (s > 0) & (positions < s + keep)
    return torch.where(replayed.to(slot_mapping.device), -1, slot_mapping)


class _UnusedImpl:
    """`get_impl_cls` is abstract, but caches owned by the model never run an impl."""


class PagedCacheBackend(AttentionBackend):
    supported_dtypes = [torch.float32, torch.bfloat16, torch.float16]
    forward_includes_kv_cache_update = True

    @staticmethod
    def get_name() -> str:
        return "DEEPINFER_PAGED"

    @staticmethod
    def get_impl_cls():
        return _UnusedImpl

    @staticmethod
    def get_builder_cls():
        return PagedStepMetadataBuilder

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """The block size the model's caches were built with: vLLM (0.33 on the CPU)
        picks the block size from this after the model is built, and specs already made
        cannot follow a new one."""
        return max(built_block_sizes(), default=default_block_size)

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        """Only the size the caches were built with, once they are (so a later alignment
        of the block size fails in vLLM's check instead of leaving the specs behind)."""
        built = built_block_sizes()
        return block_size is None or not built or block_size in built

    @classmethod
    def supported_kv_cache_layouts(cls):
        # Block-outermost lets every group keep 16-token blocks whatever its row width,
        # instead of inflating block sizes until all groups have equal page bytes.
        return (KVCacheLayout.BLNHC, KVCacheLayout.BLHNC)


def built_block_sizes() -> set[int]:
    """Block sizes of the paged caches built under the current vLLM config."""
    context = get_current_vllm_config().compilation_config.static_forward_context
    return {layer.spec.block_size for layer in context.values() if isinstance(layer, PagedCache)}


class PagedCache(nn.Module, AttentionLayerBase):
    """One paged cache: rows addressed by (request, position).

    `name` must be unique and contain exactly one integer, the layer index: that is how
    the runner maps caches to layers. With a `record` format (kv_cache/precision.py) rows
    are stored as its uint8 records and read back in `dtype`.
    """

    def __init__(
        self,
        name: str,
        spec: KVCacheSpec,
        record: RecordFormat | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.name = name
        self.spec = spec
        self.record, self.dtype = record, dtype
        self.kv_cache = torch.tensor([])
        forward_context = get_current_vllm_config().compilation_config.static_forward_context
        if name in forward_context:
            raise ValueError(f"duplicate cache name {name}")
        forward_context[name] = self

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return self.spec

    def get_attn_backend(self) -> type[AttentionBackend]:
        return PagedCacheBackend

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        # The runner binds a [num_blocks, 1, rows_per_block, width] view.
        self.kv_cache = kv_cache

    def metadata(self) -> PagedStepMetadata | None:
        """This step's metadata, or None in profile/dummy runs (no caches bound)."""
        all_metadata = get_forward_context().attn_metadata
        if not isinstance(all_metadata, dict):
            return None
        return all_metadata.get(self.name)

    def _rows(self, md: PagedStepMetadata, slots: torch.Tensor):
        return slots // md.block_size, (slots % md.block_size) // md.tokens_per_state

    def write(self, md: PagedStepMetadata, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Stores rows at token slots (slot -1 marks padding and is skipped): through the
        C kernel (kernels/sparse_attention.py) where it takes the rows, a dozen aten calls
        otherwise."""
        if sparse_attention.writes(self, rows):
            sparse_attention.write_rows(
                self.kv_cache, md.block_size, md.tokens_per_state, slots, rows
            )
            return
        keep = slots >= 0
        block, row = self._rows(md, slots[keep])
        rows = rows[keep]
        if self.record is not None:
            if rows.shape[0] == 0:
                return
            rows = self.record.encode(rows.float())
        self.kv_cache[block, 0, row] = rows.to(self.kv_cache.dtype)

    def slots(self, md: PagedStepMetadata, req: int, positions: torch.Tensor) -> torch.Tensor:
        block = md.block_table[req, positions // md.block_size]
        return block * md.block_size + positions % md.block_size

    def read(self, md: PagedStepMetadata, req: int, positions: torch.Tensor) -> torch.Tensor:
        """Rows of request `req` at token positions (any token of a state's group)."""
        block, row = self._rows(md, self.slots(md, req, positions))
        rows = self.kv_cache[block, 0, row]
        return rows if self.record is None else self.record.decode(rows, self.dtype)
