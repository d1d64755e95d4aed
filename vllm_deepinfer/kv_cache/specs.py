"""Every cache V4.1 keeps, as the paged caches vLLM's KV cache manager allocates:

- per layer, the SWA latents of its own last `sliding_window` tokens;
- per kv source, compressed latents and index keys (one row per `ratio` tokens) and, for
  ratio 2, the fp32 [kv | gate score] rows of the still-open group;
- Engram's token history, so n-grams reach back across chunks and decode steps.

With bounded replay (`keep` > 0) only the global KV is prefix-cached: the window caches
(SWA latents, the open group, Engram's history) are rebuilt by replay on a hit
(kv_cache/bounded_replay.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

from vllm_deepinfer.kv_cache.bounded_replay import ReplayWindowSpec
from vllm_deepinfer.kv_cache.paged import PagedCache


def _window(keep: int, lookback: int = 0, **spec) -> SlidingWindowMLASpec:
    """A window cache: prefix-cached in exact mode (keep 0), else rebuilt by replay."""
    if not keep:
        return SlidingWindowMLASpec(num_kv_heads=1, **spec)
    return ReplayWindowSpec(num_kv_heads=1, replay_tokens=keep, lookback_tokens=lookback,
                            **spec)


def swa_latents(prefix: str, a, block_size: int, dtype: torch.dtype, keep: int) -> PagedCache:
    return PagedCache(f"{prefix}.swa_kv", _window(
        keep, block_size=block_size, head_size=a.head_dim, dtype=dtype,
        sliding_window=a.sliding_window))


class CompressedCaches(nn.Module):
    """A kv source's compressed latents and index keys, and its open ratio-2 group."""

    def __init__(self, a, layer: int, prefix: str, block_size: int, dtype: torch.dtype,
                 keep: int):
        super().__init__()
        ratio = a.ratio(layer)
        self.latents = PagedCache(f"{prefix}.compressed_kv", MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=a.head_dim, dtype=dtype,
            tokens_per_state=ratio))
        self.index_keys = PagedCache(f"{prefix}.index_k", MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=a.index_head_dim, dtype=dtype,
            tokens_per_state=ratio))
        self.open_group = None
        if ratio == 2:
            self.open_group = PagedCache(f"{prefix}.compressor_state", _window(
                keep, block_size=block_size, head_size=2 * a.head_dim,
                dtype=torch.float32, sliding_window=ratio))


def engram_token_history(prefix: str, a, block_size: int, keep: int) -> PagedCache:
    """Compressed token ids (stored as fp32) of the last engram_max_ngram_size tokens; a
    replay reads the ids before its start from the runner (`lookback_tokens`)."""
    n = a.engram_max_ngram_size
    return PagedCache(f"{prefix}.engram.token_history", _window(
        keep, lookback=n - 1, block_size=block_size, head_size=1, dtype=torch.float32,
        sliding_window=n))
