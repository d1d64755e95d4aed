"""The full-size V4.1-Flash config yields exactly the release checkpoint's tensors.

Shapes and counts below are the release's, from the shared architecture facts; the model
is instantiated on the meta device, so no memory is spent on its 280 billion weights.
The release declares the vision-language architecture: beside the text backbone it
carries a vision tower, image-span vectors and `bias_vl` on every MoE layer, named as
upstream vLLM's loader expects them (vllm/models/deepseek_v41/nvidia/vl_model.py,
deepseek_v4/common/vision.py).
"""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fixtures.tiny import QUANTIZATION_CONFIG
from vllm_deepinfer.checkpoint.layout import backbone_layout, checkpoint_layout, stored_tensors
from vllm_deepinfer.model.deepseek_v41.args import V41Args
from vllm_deepinfer.model.deepseek_v41.engram import EngramHashing

FLASH = {
    "vocab_size": 129280,
    "hidden_size": 5120,
    "num_hidden_layers": 40,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20,
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "rope_type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 384,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2304,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "engram_layer_ids": [1, 14],
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_vocab_size": 16000000,
    "engram_compressed_vocab_size": 99092,
    "engram_pad_token_id": 2,
    "engram_num_embeddings": [384006168, 384016682],
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
    "rms_norm_eps": 1e-6,
}
# The vision tower's sizes are vLLM's DeepseekV41Config defaults; the shared facts do not
# give the release's layer count, so 24 is an assumption.
FLASH_VISION = {
    "model_type": "deepseek_v41_vision",
    "num_hidden_layers": 24,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "intermediate_size": 2816,
    "patch_size": 14,
    "downsample_ratio": 3,
}
RELEASE_CONFIG = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "text_config": FLASH,
    "vision_config": FLASH_VISION,
    "quantization_config": QUANTIZATION_CONFIG,
}
E4M3, E8M0, I8 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8
BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(scope="module")
def flash():
    return V41Args.from_hf_config(SimpleNamespace(**FLASH))


@pytest.fixture(scope="module")
def stored(flash):
    return stored_tensors(checkpoint_layout(flash, quantized=True))


@pytest.fixture(scope="module")
def release():
    return V41Args.from_release_config(RELEASE_CONFIG)


@pytest.fixture(scope="module")
def stored_release(release):
    return stored_tensors(checkpoint_layout(release, quantized=True))


@pytest.mark.unit
@pytest.mark.parametrize(
    "name,shape,dtype",
    [
        ("embed.weight", (129280, 5120), torch.bfloat16),
        ("head.weight", (129280, 5120), torch.bfloat16),
        ("layers.5.attn.wq_a.weight", (1280, 5120), E4M3),
        ("layers.5.attn.wq_a.scale", (40, 160), E8M0),
        ("layers.5.attn.wkv.weight", (512, 5120), E4M3),
        ("layers.5.attn.wq_b.weight", (32768, 1280), E4M3),
        ("layers.5.attn.wo_a.weight", (8192, 4096), E4M3),
        ("layers.5.attn.wo_b.weight", (5120, 8192), E4M3),
        ("layers.5.attn.attn_sink", (64,), torch.float32),
        ("layers.5.hc_attn_fn", (24, 20480), torch.float32),
        ("layers.5.ffn.gate.weight", (384, 5120), torch.bfloat16),
        ("layers.5.ffn.gate.bias", (384,), torch.float32),
        ("layers.5.ffn.experts.383.w1.weight", (2304, 2560), I8),
        ("layers.5.ffn.experts.383.w1.scale", (2304, 160), E8M0),
        ("layers.5.ffn.experts.0.w2.weight", (5120, 1152), I8),
        ("layers.5.ffn.experts.0.w2.scale", (5120, 72), E8M0),
        ("layers.2.attn.compressor.wgate.weight", (512, 5120), torch.bfloat16),
        ("layers.20.attn.compressor.wkv.weight", (512, 5120), torch.bfloat16),
        ("layers.20.attn.indexer.wk.weight", (128, 512), torch.bfloat16),
        ("layers.24.attn.indexer.wq_b.weight", (4096, 1280), E4M3),
        ("layers.24.attn.indexer.weights_proj.weight", (32, 5120), torch.bfloat16),
        ("layers.1.engram.embed.weight", (384006168, 256), E4M3),
        ("layers.1.engram.embed.scale", (384006168, 8), E8M0),
        ("layers.14.engram.wkv.weight", (25600, 6144), E4M3),
        ("mtp.0.main_proj.weight", (5120, 15360), E4M3),
        ("mtp.2.confidence_head.proj.weight", (1, 5376), torch.float32),
        ("mtp.2.markov_head.head.weight", (129280, 256), torch.bfloat16),
    ],
)
def test_release_tensor_shapes(stored, name, shape, dtype):
    assert stored[name] == (shape, dtype)


@pytest.mark.unit
def test_release_tensor_counts(stored):
    def count(prefix):
        return sum(name.startswith(prefix) for name in stored)

    assert len(stored) == 95776
    assert (count("layers.0."), count("layers.1."), count("layers.2.")) == (2333, 2339, 2341)
    assert count("mtp.") == 2398
    assert "layers.20.attn.compressor.wgate.weight" not in stored  # ratio 1 has no gate
    assert "layers.24.attn.indexer.wk.weight" not in stored  # not a kv source
    assert not any(name.startswith("layers.3.attn.compressor") for name in stored)


@pytest.mark.unit
@pytest.mark.parametrize(
    "name,shape,dtype",
    [
        ("layers.0.ffn.gate.bias_vl", (384,), F32),
        ("layers.39.ffn.gate.bias_vl", (384,), F32),
        ("mtp.2.ffn.gate.bias_vl", (128,), F32),
        ("vision.patch_embed.proj.weight", (1024, 3 * 14 * 14), BF16),
        ("vision.patch_embed.proj.bias", (1024,), BF16),
        ("vision.blocks.23.attn.wqkv.weight", (3072, 1024), BF16),
        ("vision.blocks.23.attn.wqkv.bias", (3072,), BF16),
        ("vision.blocks.0.attn.wo.weight", (1024, 1024), BF16),
        ("vision.blocks.0.mlp.w1.weight", (2 * 2816, 1024), BF16),
        ("vision.blocks.0.mlp.w2.weight", (1024, 2816), BF16),
        ("vision.blocks.0.norm1.weight", (1024,), BF16),
        ("vision.norm.weight", (1024,), BF16),
        ("aligner.w1.weight", (5120, 1024 * 9), BF16),
        ("aligner.w2.weight", (5120, 5120), BF16),
        ("aligner.w2.bias", (5120,), BF16),
        ("image_newline", (5120,), F32),
    ],
)
def test_vision_language_release_tensor_shapes(stored_release, name, shape, dtype):
    assert stored_release[name] == (shape, dtype)


@pytest.mark.unit
def test_vision_language_release_tensor_counts(stored, stored_release):
    """Text release + one bias_vl per MoE layer (40 backbone, 3 draft stages) + the
    tower: patch embedding (2), 8 tensors a block, final norm, aligner (4), 3 vectors."""
    added = set(stored_release) - set(stored)
    assert set(stored) <= set(stored_release)
    assert sum(name.endswith(".ffn.gate.bias_vl") for name in added) == 40 + 3
    assert sum(name.startswith("vision.blocks.") for name in added) == 24 * 8
    assert len(added) == 43 + 2 + 24 * 8 + 1 + 4 + 3
    assert not any(
        name.startswith(("vision.", "aligner.")) and name.endswith(".scale")
        for name in stored_release
    )  # the tower is never quantized


@pytest.mark.unit
def test_engram_hashing_matches_release(flash):
    """Multipliers, bucket primes and table sizes of the release's two Engram layers."""
    hashing = EngramHashing(flash, 99092, pad_compressed_id=0)
    assert hashing.multipliers[1].tolist() == [
        76632096046245,
        4839876093313,
        35959672319349,
        73987337458391,
    ]
    assert hashing.multipliers[14].tolist() == [
        67716810739261,
        51510806800915,
        30921347202721,
        82619226485591,
    ]
    assert hashing.primes[1][0] == 16000057 and hashing.primes[1][-1] == 16000463
    assert (hashing.rows_needed(1), hashing.rows_needed(14)) == (384006168, 384016682)


@pytest.mark.engine
def test_model_on_meta_device_has_exactly_the_release_tensors(release, tmp_path):
    """Every backbone tensor of the vision-language release (bias_vl included) maps onto
    one model parameter of its shape as stored (MXFP8 values and their scales, MXFP4
    experts packed with theirs: release precision is kept), every model parameter is fed
    by the checkpoint, and the Engram tables are no parameters (they are mapped). The
    model is built in a fresh process, which needs vLLM's (single-rank) distributed state
    of its own."""
    from vllm_deepinfer.model.deepseek_v41.model import DeepseekV41ForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(RELEASE_CONFIG))
    script = Path(__file__).with_name("meta_model_params.py")
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    params = {name: tuple(shape) for name, shape in json.loads(run.stdout.splitlines()[-1]).items()}

    expected: dict[str, tuple] = {}
    for name, spec in backbone_layout(release, quantized=True).items():
        if ".ffn.experts." in name or ".engram.embed." in name:
            continue
        for stored, (shape, _) in spec.stored(name).items():
            param = DeepseekV41ForCausalLM.param_name(stored)
            if DeepseekV41ForCausalLM.row_block(stored) is not None:  # wkv, wgate: one product
                rows = expected.get(param, (0,))[0] + shape[0]
                shape = (rows, *shape[1:])
            expected[param] = shape
    assert "model.layers.39.ffn.gate.bias_vl" in expected
    assert expected["model.layers.5.attn.wo_a_scale"] == (256, 128)
    assert expected["model.layers.2.attn.compressor.wkv_gate.weight"] == (1024, 5120)
    assert expected["model.layers.20.attn.compressor.wkv_gate.weight"] == (512, 5120)
    for layer in range(release.num_hidden_layers):
        experts = f"model.layers.{layer}.ffn.experts"
        expected[f"{experts}.w13"] = (384, 2 * 2304, 5120 // 2)
        expected[f"{experts}.w13_scale"] = (384, 2 * 2304, 5120 // 32)
        expected[f"{experts}.w2"] = (384, 5120, 2304 // 2)
        expected[f"{experts}.w2_scale"] = (384, 5120, 2304 // 32)
    assert params == expected
