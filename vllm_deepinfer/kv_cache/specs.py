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
from vllm_deepinfer.kv_cache.precision import RecordFormat, index_key_format, latent_format


def global_kv_records(vllm_config) -> tuple[RecordFormat | None, RecordFormat | None]:
    """The records of compressed latents and index keys vLLM's settings ask for."""
    attention = getattr(vllm_config, "attention_config", None)
    return (
        latent_format(vllm_config.cache_config.cache_dtype),
        index_key_format(getattr(attention, "indexer_kv_dtype", None)),
    )


def _window(keep: int, lookback: int = 0, **spec) -> SlidingWindowMLASpec:
    """A window cache: prefix-cached in exact mode (keep 0), else rebuilt by replay."""
    if not keep:
        return SlidingWindowMLASpec(num_kv_heads=1, **spec)
    return ReplayWindowSpec(num_kv_heads=1, replay_tokens=keep, lookback_tokens=lookback, **spec)


def swa_latents(prefix: str, a, block_size: int, dtype: torch.dtype, keep: int) -> PagedCache:
    return PagedCache(
        f"{prefix}.swa_kv",
        _window(
            keep,
            block_size=block_size,
            head_size=a.head_dim,
            dtype=dtype,
            sliding_window=a.sliding_window,
        ),
    )


def _global(
    name: str,
    width: int,
    ratio: int,
    block_size: int,
    dtype: torch.dtype,
    record: RecordFormat | None,
) -> PagedCache:
    """A prefix-cached cache of one row per `ratio` tokens, in the model dtype or as the
    release's quantized records."""
    stored = (width, dtype) if record is None else (record.record_bytes, torch.uint8)
    return PagedCache(
        name,
        MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=stored[0],
            dtype=stored[1],
            tokens_per_state=ratio,
        ),
        record,
        dtype,
    )


class CompressedCaches(nn.Module):
    """A kv source's compressed latents and index keys (global KV, in the precisions the
    user chose: vLLM's --kv-cache-dtype and attention_config.indexer_kv_dtype), and its
    open ratio-2 group."""

    def __init__(
        self,
        a,
        layer: int,
        prefix: str,
        block_size: int,
        dtype: torch.dtype,
        keep: int,
        vllm_config,
    ):
        super().__init__()
        ratio = a.ratio(layer)
        latent_record, key_record = global_kv_records(vllm_config)
        self.latents = _global(
            f"{prefix}.compressed_kv", a.head_dim, ratio, block_size, dtype, latent_record
        )
        self.index_keys = _global(
            f"{prefix}.index_k", a.index_head_dim, ratio, block_size, dtype, key_record
        )
        self.open_group = None
        if ratio == 2:
            self.open_group = PagedCache(
                f"{prefix}.compressor_state",
                _window(
                    keep,
                    block_size=block_size,
                    head_size=2 * a.head_dim,
                    dtype=torch.float32,
                    sliding_window=ratio,
                ),
            )


def engram_token_history(prefix: str, a, block_size: int, keep: int) -> PagedCache:
    """Compressed token ids (stored as fp32) of the last engram_max_ngram_size tokens; a
    replay reads the ids before its start from the runner (`lookback_tokens`)."""
    n = a.engram_max_ngram_size
    return PagedCache(
        f"{prefix}.engram.token_history",
        _window(
            keep,
            lookback=n - 1,
            block_size=block_size,
            head_size=1,
            dtype=torch.float32,
            sliding_window=n,
        ),
    )
