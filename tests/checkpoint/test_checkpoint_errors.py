"""Bad checkpoints fail loading with errors that name the tensor or the contradiction."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from fixtures.reference import read_checkpoint
from vllm_deepinfer.checkpoint.layout import backbone_layout
from vllm_deepinfer.checkpoint.loader import CheckpointError, checked
from vllm_deepinfer.model.deepseek_v41.args import V41Args, V41ConfigError
from vllm_deepinfer.model.deepseek_v41.engram import EngramVocabularyError, engram_addressing


@pytest.fixture(scope="module")
def quantized(quantized_checkpoint):
    args, _ = read_checkpoint(quantized_checkpoint)
    tensors = load_file(f"{quantized_checkpoint}/model.safetensors")
    backbone = {n: t for n, t in tensors.items() if not n.startswith("mtp.")}
    return args, backbone


def load(args, tensors):
    for _ in checked(tensors.items(), backbone_layout(args, quantized=True)):
        pass


@pytest.mark.unit
def test_complete_checkpoint_loads(quantized):
    load(*quantized)


def without(name):
    return lambda tensors: {n: t for n, t in tensors.items() if n != name}


def replacing(name, make):
    return lambda tensors: {**tensors, name: make(tensors)}


@pytest.mark.unit
@pytest.mark.parametrize(
    "break_it,message",
    [
        (
            without("layers.4.attn.compressor.wgate.weight"),
            r"missing 1 tensors: layers\.4\.attn\.compressor\.wgate\.weight",
        ),
        (
            replacing("layers.3.attn.compressor.wkv.weight", lambda t: torch.zeros(512, 256)),
            r"unexpected tensor layers\.3\.attn\.compressor\.wkv\.weight",
        ),
        (
            replacing("layers.0.attn.attn_sink", lambda t: torch.zeros(5)),
            r"layers\.0\.attn\.attn_sink has shape \(5,\), expected \(4,\)",
        ),
        (
            without("layers.2.ffn.experts.5.w3.scale"),
            r"without a \.scale: \['layers\.2\.ffn\.experts\.5\.w3\.weight'\]",
        ),
        (
            replacing("layers.0.attn.wq_a.scale", lambda t: t["layers.0.attn.wq_a.scale"][:1]),
            r"layers\.0\.attn\.wq_a\.weight: MXFP8 scale shape",
        ),
    ],
)
def test_bad_tensor_is_named(quantized, break_it, message):
    args, tensors = quantized
    with pytest.raises(CheckpointError, match=message):
        load(args, break_it(tensors))


@pytest.mark.unit
@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"compress_ratios": [0, 0, 0, 2, 2, 2, 1, 1, 1, 1]},
            "kv source layer 2 has compress ratio 0",
        ),
        ({"compress_ratios": [0, 0, 2, 2]}, "compress_ratios has 4 entries for 10 layers"),
        (
            {"index_source_layer_ids": [2, 6, 8]},
            "layer 4 reuses the top-k of layer 2, which indexes kv source 2, not its own kv source 4",
        ),
        ({"kv_source_layer_ids": [2, 4, 7]}, r"layer 6 \(ratio 1\) reads kv source 4 of ratio 2"),
        ({"compress_ratios": [0, 0, 2, 2, 3, 2, 1, 1, 1, 1]}, "may only hold 0, 1 or 2"),
        ({"engram_num_embeddings": [10]}, "one entry per Engram layer"),
        ({"engram_layer_ids": [0, 4]}, "engram_layer_ids may not hold layer 0"),
    ],
)
def test_contradictory_config_is_explained(tiny_checkpoint, change, message):
    args, _ = read_checkpoint(tiny_checkpoint)
    fields = {**dataclasses.asdict(args), **change}
    with pytest.raises(V41ConfigError, match=message):
        V41Args.from_hf_config(SimpleNamespace(**fields))


@pytest.mark.unit
@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"engram_compressed_vocab_size": 5},
            r"the tokenizer normalises to \d+ Engram ids, but the config says "
            r"engram_compressed_vocab_size=5",
        ),
        (
            {"vocab_size": 1000},
            "the tokenizer has 129280 tokens but the config's vocab_size is 1000",
        ),
        (
            {"engram_num_embeddings": (64, 64)},
            "Engram layer 1 hashes into \\d+ rows but engram_num_embeddings gives 64",
        ),
    ],
)
def test_tokenizer_that_disagrees_with_the_config_is_explained(tiny_checkpoint, change, message):
    """Engram's token map walks the tokenizer's own length and must give exactly the
    config's compressed vocabulary."""
    args, _ = read_checkpoint(tiny_checkpoint)
    tokenizer = Tokenizer.from_file(f"{tiny_checkpoint}/tokenizer.json")
    with pytest.raises(EngramVocabularyError, match=message):
        engram_addressing(tokenizer, dataclasses.replace(args, **change))


@pytest.mark.engine
def test_engine_start_reports_the_missing_tensor(tiny_checkpoint, tmp_path):
    """Through vLLM: the engine refuses the checkpoint and says which tensor is missing."""
    import shutil

    from safetensors.torch import save_file

    from helpers import make_llm

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_checkpoint}/{name}", tmp_path / name)
    tensors = load_file(f"{tiny_checkpoint}/model.safetensors")
    del tensors["layers.7.ffn.gate.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(Exception, match=r"layers\.7\.ffn\.gate\.bias"):
        make_llm(str(tmp_path))
