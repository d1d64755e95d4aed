"""Every cache V4.1 keeps, as the paged caches vLLM's KV cache manager allocates:

- per layer, the SWA latents of its own last `sliding_window` tokens;
- per kv source, compressed latents and index keys (one row per `ratio` tokens) and, for
  ratio 2, the fp32 [kv | gate score] rows of the still-open group;
- Engram's token history, so n-grams reach back across chunks and decode steps.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

from vllm_deepinfer.kv_cache.paged import PagedCache


def swa_latents(prefix: str, a, block_size: int, dtype: torch.dtype) -> PagedCache:
    return PagedCache(f"{prefix}.swa_kv", SlidingWindowMLASpec(
        block_size=block_size, num_kv_heads=1, head_size=a.head_dim, dtype=dtype,
        sliding_window=a.sliding_window))


class CompressedCaches(nn.Module):
    """A kv source's compressed latents and index keys, and its open ratio-2 group."""

    def __init__(self, a, layer: int, prefix: str, block_size: int, dtype: torch.dtype):
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
            self.open_group = PagedCache(f"{prefix}.compressor_state", SlidingWindowMLASpec(
                block_size=block_size, num_kv_heads=1, head_size=2 * a.head_dim,
                dtype=torch.float32, sliding_window=ratio))


def engram_token_history(prefix: str, a, block_size: int) -> PagedCache:
    """Compressed token ids (stored as fp32) of the last engram_max_ngram_size tokens."""
    return PagedCache(f"{prefix}.engram.token_history", SlidingWindowMLASpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32,
        sliding_window=a.engram_max_ngram_size))
