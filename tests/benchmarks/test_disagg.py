"""The all_groups rule of benchmarks/disagg.py (`kv_bytes`), on specs shaped like the tiny
V4.1's in fp32 with keep 140, against counts done by hand."""

import importlib
from pathlib import Path

import pytest
import torch
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

from vllm_deepinfer.kv_cache.bounded_replay import ReplayWindowSpec

pytestmark = pytest.mark.unit

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def disagg(monkeypatch):
    """benchmarks/ is a folder of scripts: disagg imports its neighbour soak by name."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("disagg")


def window(width: int, sliding_window: int) -> ReplayWindowSpec:
    return ReplayWindowSpec(
        block_size=16,
        num_kv_heads=1,
        head_size=width,
        dtype=torch.float32,
        sliding_window=sliding_window,
        replay_tokens=140,
    )


def compressed(width: int, ratio: int) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=width, dtype=torch.float32, tokens_per_state=ratio
    )


def test_windows_hold_their_window_and_the_replayed_tokens(disagg):
    # 4096 tokens: 256 blocks; a 32-token window with keep 140 keeps tokens from
    # 4096 - 32 + 1 - 109 = 3956 on: blocks 247..255.
    assert disagg.blocks_held(window(512, 32), 4096) == 9
    # Exact mode (no replay): tokens from 4096 - 32 + 1 = 4065 on, blocks 254..255.
    exact = SlidingWindowMLASpec(
        block_size=16, num_kv_heads=1, head_size=512, dtype=torch.float32, sliding_window=32
    )
    assert disagg.blocks_held(exact, 4096) == 2
    assert disagg.blocks_held(compressed(512, 2), 4096) == 256
    assert disagg.blocks_held(window(512, 32), 20) == 2  # a short prompt: nothing freed


def test_kv_bytes_of_a_tiny_like_model(disagg):
    specs = {f"model.layers.{i}.attn.swa_kv": window(512, 32) for i in range(10)}
    for layer, ratio in ((2, 2), (4, 2), (6, 1)):
        specs[f"model.layers.{layer}.attn.compressed_kv"] = compressed(512, ratio)
        specs[f"model.layers.{layer}.attn.index_k"] = compressed(128, ratio)
        if ratio == 2:
            specs[f"model.layers.{layer}.attn.compressor_state"] = window(1024, 2)
    specs["model.layers.1.engram.token_history"] = window(1, 4)

    counted = disagg.kv_bytes(specs, 4096)
    # Global KV: 5120 B/token (precision.py's formula for the tiny model in fp32).
    assert counted["prefix_cached"] == 5120 * 4096
    # Windows, 9 blocks each: 10 SWA pages of 16 x 512 x 4, 2 open-pair pages of
    # 16 x 1024 x 4, Engram's 16 x 4.
    assert counted["all_groups"] == 5120 * 4096 + 9 * (10 * 32768 + 2 * 65536 + 64)
