"""The per-token costs benchmarks/throughput.py prints (benchmarks/model_costs.py), against
counts done by hand: the embedded tiny V4.1 config and a small Llama."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fixtures.tiny import TEXT_CONFIG
from vllm_deepinfer.model.deepseek_v41.args import V41Args

pytestmark = pytest.mark.unit


def _load_model_costs():
    """benchmarks/ is a folder of scripts, not a package (importlib's recipe for a source
    file; its dataclasses look their module up in sys.modules)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "model_costs.py"
    spec = importlib.util.spec_from_file_location("model_costs", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


costs = _load_model_costs()

# Engram's table sizes come from the tokenizer when the checkpoint is written; they only
# size lookups, which no count below includes.
TINY = V41Args.from_hf_config(
    SimpleNamespace(
        **TEXT_CONFIG, engram_compressed_vocab_size=1000, engram_num_embeddings=[5000, 5000]
    )
)
LLAMA = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
}


def test_tiny_v41_kv_bytes():
    # 10 layers of 512-wide window latents; kv sources 2 and 4 (ratio 2) and 6 (ratio 1)
    # keep a 512-wide latent and a 128-wide index key per `ratio` tokens; sources 2 and 4
    # also hold the open pair's fp32 [kv | gate] (2 x 512); Engram layers 1 and 4 one fp32
    # id each.
    fp32 = costs.v41_kv_bytes(TINY, 4)
    assert fp32.beyond_windows == 640 * 4 // 2 * 2 + 640 * 4 == 5120
    assert fp32.per_token == 10 * 512 * 4 + 5120 + 2 * 1024 * 4 + 2 * 4 == 33800
    bf16 = costs.v41_kv_bytes(TINY, 2)  # open groups and Engram stay fp32
    assert bf16 == costs.KVBytes(10 * 512 * 2 + 2560 + 8192 + 8, 2560)


def test_tiny_v41_flops():
    per_layer = (
        2 * 24 * 1024  # hc_attn_fn, hc_ffn_fn: (2 + 4) * 4 mixes of 4 x 256 copies
        + 128 * 256
        + 512 * 256
        + 2048 * 128  # wq_a, wkv, wq_b (4 heads x 512)
        + 128 * 1024
        + 256 * 128  # wo_a (2 groups x 64, of 2 heads x 512), wo_b
        + 8 * 256  # router
        + 2 * 3 * 64 * 256
        + 3 * 64 * 256
    )  # 2 of 8 routed experts, shared expert
    indexers = 4 * (512 * 128 + 4 * 256)  # layers 2, 4, 6, 8: wq_b, weights_proj
    engram = 2 * (1280 * 192)  # layers 1 and 4: wkv, 3 orders x 2 heads x 32 -> 5 x 256
    head = 2 * 129280 * 256
    per_key = 2 * 2 * 4 * 512  # q.k and the weighted sum (key = value), 4 heads of 512
    per_scored_group = 2 * 4 * (128 + 1)  # 4 index heads of 128, then their weighted sum
    compressor = (
        2 * (2 * 256 * 512 * 2 + 2 * 512 * 128 // 2)  # 2, 4: wkv + wgate; wk/2
        + 2 * 256 * 512
        + 2 * 512 * 128
    )  # source 6, ratio 1
    # Context 1024: windows of 32; top-16 on compressed layers 2-9; index sources 2 and 4
    # score 512 groups, 6 and 8 score 1024.
    long = per_key * (2 * 32 + 8 * (32 + 16)) + per_scored_group * (2 * 512 + 2 * 1024) + compressor
    # Context 20: a 20-token window; 10 pairs (layers 2-5) are fewer than the top-16.
    short = (
        per_key * (2 * 20 + 4 * (20 + 10) + 4 * (20 + 16))
        + per_scored_group * (2 * 10 + 2 * 20)
        + compressor
    )

    flops = costs.v41_flops(TINY, [20, 1024])
    assert flops == costs.FlopCount(
        2 * (10 * per_layer + indexers + engram), {20: short, 1024: long}, head
    )
    assert (flops.matmul, flops.attention[1024]) == (17285120, 8413184)


def test_llama_kv_bytes_and_flops():
    assert costs.llama_kv_bytes(LLAMA, 4) == costs.KVBytes(2 * 2 * 2 * 16 * 4, 512)
    flops = costs.llama_flops(LLAMA, [100])
    per_layer = 64 * 64 + 2 * (32 * 64) + 64 * 64 + 3 * 128 * 64  # q, k and v, o, MLP
    assert flops == costs.FlopCount(
        2 * 2 * per_layer, {100: 2 * 2 * 2 * 4 * 16 * 100}, 2 * 1000 * 64
    )
