"""V4.1's compressor against code the project did not write.

What V4.1 does (vLLM's own V4.1 port, vllm/models/deepseek_v41/compressor.py:175-201):
ratio 2 pools each pair of tokens with a per-dimension softmax over the two gate scores,
ratio 1 keeps the token's `wkv` row (no gate), the pooled row is RMSNormed and RoPE'd at
the group's *first* position, and the lightning indexer's key is
k_norm(wk(latent)), RoPE'd at the same position.

Oracles:
* transformers' DeepseekV4HCACompressor (modeling_deepseek_v4.py, class at line 358). V4's
  compressors differ from V4.1's in two ways: HCA (ratio 128) adds a learned
  `position_bias` (an absolute position embedding) to the gate scores, and CSA (ratio 4)
  pools overlapping windows of 2 x ratio tokens (two series Ca/Cb). With the rate set to
  V4.1's 1 or 2 and the position bias zero, HCA's non-overlapping window softmax is
  exactly V4.1's pooling, so that is the case compared.
* upstream vLLM's V4.1 compressor and indexer-key kernels are Triton only, so
  `_emulate_v41_compress` below re-states them in torch, written from their source; the
  RoPE table comes from upstream's own `build_deepseek_v4_rope` (imported).
"""

from types import SimpleNamespace

import pytest
import torch

from helpers import upstream
from vllm_deepinfer.model.deepseek_v41.compressor import pool_pair
from vllm_deepinfer.model.deepseek_v41.ops import rms_norm
from vllm_deepinfer.model.deepseek_v41.rope import apply_rope, layer_rope_scaling, rope_inv_freq

pytestmark = pytest.mark.unit

# fp64 on our side. transformers computes cos/sin in fp32 whatever the module dtype, and
# vLLM's RoPE table is fp32; observed differences <= 1e-6 on values up to ~4.
ROPE_FP32_TOL = dict(atol=1e-5, rtol=1e-5)

HIDDEN, HEAD_DIM, ROPE_DIM, INDEX_DIM = 32, 32, 16, 16
COMPRESS_THETA, EPS = 160000.0, 1e-6
# original_max_position_embeddings is small so that YaRN's ramp falls inside the 8 pairs
# (pairs 0-1 ramp, pairs 2-7 fully interpolated), i.e. the scaling actually shows.
YARN = {
    "rope_type": "yarn",
    "factor": 16.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
}


# --- the project's compressor path, written as the project composes it ----------------
def ours_compress(
    kv: torch.Tensor,
    score: torch.Tensor | None,
    ratio: int,
    norm_w: torch.Tensor,
    inv_freq: torch.Tensor,
):
    """(RoPE'd latents, un-RoPE'd latents, group starts) of every closed group of a
    sequence that starts at position 0 -- as ReferenceV41._compress and
    V41Compressor.store combine pool_pair / rms_norm / apply_rope."""
    groups = kv.shape[0] // ratio
    if ratio == 2:
        pooled = pool_pair(
            torch.stack([kv[0 : 2 * groups : 2], kv[1 : 2 * groups : 2]]),
            torch.stack([score[0 : 2 * groups : 2], score[1 : 2 * groups : 2]]),
        )
    else:
        pooled = kv[:groups]
    latent = rms_norm(pooled, norm_w, EPS)
    start = torch.arange(groups) * ratio
    return apply_rope(latent, start, inv_freq), latent, start


def random_inputs(seed: int, tokens: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g, dtype=dtype)
    wkv = torch.randn(HEAD_DIM, HIDDEN, generator=g, dtype=dtype) / HIDDEN**0.5
    # Gate scores O(2): the pair softmax is far from uniform and from one-hot.
    wgate = torch.randn(HEAD_DIM, HIDDEN, generator=g, dtype=dtype) * 2 / HIDDEN**0.5
    norm_w = torch.rand(HEAD_DIM, generator=g, dtype=dtype) + 0.5
    return x, wkv, wgate, norm_w, g


# --- 1. transformers' V4 HCA compressor at V4.1's ratios ------------------------------
def hf_hca_compressor(ratio: int, scaling: dict | None):
    config_cls = upstream("transformers", "DeepseekV4Config")
    compressor_cls = upstream(
        "transformers.models.deepseek_v4.modeling_deepseek_v4", "DeepseekV4HCACompressor"
    )
    config = config_cls(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        partial_rotary_factor=ROPE_DIM / HEAD_DIM,
        q_lora_rank=16,
        o_groups=2,
        o_lora_rank=8,
        compress_rope_theta=COMPRESS_THETA,
        rms_norm_eps=EPS,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": ratio},
        rope_parameters=dict(scaling) if scaling else None,
        max_position_embeddings=1024,
        layer_types=["sliding_attention"],
        mlp_layer_types=["moe"],
    )
    return compressor_cls(config).double().eval(), config


@pytest.mark.parametrize("scaling", [None, YARN], ids=["plain-rope", "yarn"])
@pytest.mark.parametrize("ratio", [1, 2])
@torch.no_grad()
def test_compressor_matches_hf_hca_compressor(ratio, scaling):
    """pool_pair (ratio 2) / identity (ratio 1) -> rms_norm -> RoPE at the group start,
    with our YaRN frequencies, equals HF's HCA window softmax -> kv_norm -> RoPE at
    i * rate. 21 tokens: the last, still-open group is dropped by both."""
    module, config = hf_hca_compressor(ratio, scaling)
    x, wkv, wgate, norm_w, _ = random_inputs(10 + ratio, 21)
    module.kv_proj.weight.copy_(wkv)
    module.gate_proj.weight.copy_(wgate)
    module.position_bias.zero_()  # V4.1 has no absolute position bias in the gate
    module.kv_norm.weight.copy_(norm_w)

    expected, _ = module(x[None], None, torch.arange(21)[None], None, 0)
    expected = expected[0, 0]

    inv = rope_inv_freq(ROPE_DIM, COMPRESS_THETA, layer_rope_scaling(config.rope_parameters, ratio))
    ours, latent, _ = ours_compress(x @ wkv.T, x @ wgate.T, ratio, norm_w, inv)
    assert ours.shape == expected.shape == (21 // ratio, HEAD_DIM)
    if ratio == 2:  # the pair softmax must matter, or pooling bugs could hide
        kv, score = x @ wkv.T, x @ wgate.T
        mean_pooled = rms_norm((kv[0:20:2] + kv[1:20:2]) / 2, norm_w, EPS)
        assert (mean_pooled - latent).abs().max() > 0.1
        assert (score[0:20:2] - score[1:20:2]).abs().max() > 1
    torch.testing.assert_close(ours, expected, **ROPE_FP32_TOL)


# --- 2. upstream vLLM V4.1 kernels, emulated from source ------------------------------
def _rotate_pairs(rows: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """GPT-J rotation of the last len(cos)*2 dims, rows [G, D], cos_sin [G, R] = [cos|sin];
    as the kernels do it: the row split into (even, odd) pairs, NoPE pairs get cos=1,
    sin=0 (fused_compress_quant_cache.py:489-495, indexer_k_store.py:171-185)."""
    half = cos_sin.shape[1] // 2
    even, odd = rows[:, 0::2], rows[:, 1::2]
    cos = torch.ones_like(even)
    sin = torch.zeros_like(even)
    cos[:, -half:] = cos_sin[:, :half].to(rows.dtype)
    sin[:, -half:] = cos_sin[:, half:].to(rows.dtype)
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(1)


def _emulate_v41_compress(
    kv_score: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    norm_w: torch.Tensor,
    wk: torch.Tensor,
    k_norm_w: torch.Tensor,
    cos_sin_cache: torch.Tensor,
):
    """Upstream V4.1's compress -> norm -> RoPE and index-key path for one request whose
    whole sequence is in the batch, in fp64 (the bf16 round trips are left out: this
    checks the math, not the storage precision). Returns (latents, index keys) of the
    groups in order of their closing token.

    * _fused_save_compress_norm_kernel, vllm/models/deepseek_v41/common/ops/
      fused_compress_quant_cache.py:117-212: a group closes at the token whose
      position p has (p + 1) % ratio == 0 (:199, :152); ratio 1 takes the raw kv row
      (:203-204); ratio 2 reads rows t-1 and t, kv = [:D], score = [D:2D] and takes
      sum(kv * softmax(score, over the 2 rows)) per dim (:208-211).
    * _store_latent (:215-221): RMS over D, times the norm weight.
    * the latent's RoPE (_rope_plain_insert_kernel :464-495): cos/sin of row
      p // ratio * ratio of the cache (:492), i.e. the group's first position.
    * the index key (attention.py:1405-1437 `_produce_k`: k_pre = wk(latent)) then
      _indexer_k_norm_rope_quant_store_kernel (indexer_k_store.py:123-190): RMSNorm with
      k_norm's weight (:158-162), RoPE at (p // ratio) * ratio (:179-185).
    """
    d = norm_w.shape[0]
    latents, keys = [], []
    for t in range(kv_score.shape[0]):
        p = int(positions[t])
        if (p + 1) % ratio:
            continue
        if ratio == 1:
            pooled = kv_score[t, :d]
        else:
            rows = kv_score[t - 1 : t + 1]
            weight = torch.exp(rows[:, d:] - rows[:, d:].max(0).values)
            pooled = (rows[:, :d] * weight).sum(0) / weight.sum(0)
        latent = pooled * torch.rsqrt(pooled.pow(2).mean() + EPS) * norm_w
        k = latent @ wk.T
        k = k * torch.rsqrt(k.pow(2).mean() + EPS) * k_norm_w
        cs = cos_sin_cache[p // ratio * ratio][None]
        latents.append(_rotate_pairs(latent[None], cs)[0])
        keys.append(_rotate_pairs(k[None], cs)[0])
    return torch.stack(latents), torch.stack(keys)


@pytest.fixture
def vllm_config_context():
    """vLLM's rotary is a CustomOp and wants a current vLLM config to be built."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def upstream_v41_rope(ratio: int, scaling: dict | None):
    """Upstream V4.1's rotary for a compressed layer (vllm/models/deepseek_v41/common/
    rope.py:9), built from a config the way the V4.1 attention builds it."""
    build = upstream("vllm.models.deepseek_v41.common.rope", "build_deepseek_v4_rope")
    compress = dict(scaling, attention_factor=1.0) if scaling else {"rope_type": "default"}
    config = SimpleNamespace(
        rope_parameters={"main": {"rope_type": "default"}, "compress": compress},
        rope_theta=10000.0,
        compress_rope_theta=COMPRESS_THETA,
    )
    return build(
        config,
        head_dim=HEAD_DIM,
        rope_head_dim=ROPE_DIM,
        max_position_embeddings=256,
        compress_ratio=ratio,
    )


@pytest.mark.engine_config  # vllm_config_context
@pytest.mark.parametrize("scaling", [None, YARN], ids=["plain-rope", "yarn"])
@pytest.mark.parametrize("ratio", [1, 2])
@torch.no_grad()
def test_compressor_and_index_keys_match_upstream_v41_kernels(ratio, scaling, vllm_config_context):
    """Latents and index keys (k_norm(wk(latent)), RoPE'd at the group start) from the
    project's functions, composed as V41Compressor.store composes them, equal upstream's
    V4.1 kernels (emulated) using upstream's own cos/sin table."""
    x, wkv, wgate, norm_w, g = random_inputs(20 + ratio, 23)
    wk = torch.randn(INDEX_DIM, HEAD_DIM, generator=g, dtype=torch.float64) / HEAD_DIM**0.5
    k_norm_w = torch.rand(INDEX_DIM, generator=g, dtype=torch.float64) + 0.5
    kv, score = x @ wkv.T, x @ wgate.T
    positions = torch.arange(23)
    rope = upstream_v41_rope(ratio, scaling)

    exp_latents, exp_keys = _emulate_v41_compress(
        torch.cat([kv, score], dim=-1), positions, ratio, norm_w, wk, k_norm_w, rope.cos_sin_cache
    )

    inv = rope_inv_freq(
        ROPE_DIM,
        COMPRESS_THETA,
        layer_rope_scaling(
            {"main": {"rope_type": "default"}, "compress": dict(scaling or {})}, ratio
        ),
    )
    latents, latent, start = ours_compress(kv, score, ratio, norm_w, inv)
    keys = apply_rope(rms_norm(latent @ wk.T, k_norm_w, EPS), start, inv)

    torch.testing.assert_close(latents, exp_latents, **ROPE_FP32_TOL)
    torch.testing.assert_close(keys, exp_keys, **ROPE_FP32_TOL)
