"""A small byte-level BPE tokenizer in DeepSeek's `tokenizer.json` layout.

The vocabulary is learned from a fixed embedded corpus, so the file is the same on every
machine; ids the corpus leaves unused are filled with plain filler words. DeepSeek's
special tokens sit at fixed ids inside the full-size 129280-row vocabulary, because
deepseek-recipe hard-codes the image token id (129264) and the model's bos/eos/pad are
0/1/2.
"""
from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 129280
BPE_VOCAB_SIZE = 1024

# (spelling, id). bos/eos/pad are 0/1/2 in the release; the rest live at the top of the
# vocabulary, the image token where deepseek_recipe.IMAGE_SPECIAL_TOKEN_ID expects it.
SPECIAL_TOKENS: tuple[tuple[str, int], ...] = (
    ("<｜begin▁of▁sentence｜>", 0),
    ("<｜end▁of▁sentence｜>", 1),
    ("<｜▁pad▁｜>", 2),
    ("<｜dspark_noise｜>", 128799),
    ("<｜System｜>", 128800),
    ("<｜User｜>", 128801),
    ("<｜Assistant｜>", 128802),
    ("<｜latest_reminder｜>", 128803),
    ("<think>", 128804),
    ("</think>", 128805),
    ("｜DSML｜", 128806),
    ("<｜ref｜>", 128807),
    ("<｜/ref｜>", 128808),
    ("<｜box｜>", 128809),
    ("<｜/box｜>", 128810),
    ("<｜point｜>", 128811),
    ("<｜/point｜>", 128812),
    ("<｜polygon｜>", 128813),
    ("<｜/polygon｜>", 128814),
    ("<｜image｜>", 129264),
)
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
DSPARK_NOISE_TOKEN_ID = 128799

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving engine batches requests, pages the
key-value cache into fixed blocks and schedules prefill and decode steps together.
DeepSeek models use multi-head latent attention, mixture-of-experts feed-forward layers and
hyper-connections between residual streams. Sparse attention keeps a sliding window of
recent tokens and a top-k selection of compressed tokens chosen by a lightning indexer.
An n-gram memory looks up hashed token sequences in large tables and gates them into the
residual stream. Speculative decoding drafts several tokens and verifies them in one pass.
def forward(self, input_ids, positions):
    hidden = self.embed(input_ids)
    for layer in self.layers:
        hidden = layer(hidden, positions)
    return self.norm(hidden)
{"role": "user", "content": "What is the capital of France?"}
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026 3.14159 -7 1e-6.
Café, naïve, résumé, Zürich, São Paulo, Ελληνικά, русский, 中文, 日本語, 한국어.
你好，世界。深度求索发布了新的推理引擎。今天天气很好，我们去公园散步吧。
"""


def filler_token(token_id: int) -> str:
    """The filler word at an id the corpus leaves unused (decodes as " w<id>")."""
    return f"Ġw{token_id}"


def build_tokenizer_json() -> str:
    """Train the BPE on the embedded corpus and splice in DeepSeek's special tokens."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    names = [name for name, _ in SPECIAL_TOKENS if _ < 3]
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, special_tokens=names,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS] * 8, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for name, token_id in SPECIAL_TOKENS:
        if vocab.get(name, token_id) != token_id:
            raise AssertionError(f"trainer placed {name} at {vocab[name]}, expected {token_id}")
        vocab[name] = token_id
    # Every id the model can emit decodes to text, as in the release tokenizer: the ids the
    # small corpus leaves unused become filler words that no merge produces.
    taken = set(vocab.values())
    for token_id in range(VOCAB_SIZE):
        if token_id not in taken:
            vocab[filler_token(token_id)] = token_id
    spec["added_tokens"] = [
        {"id": token_id, "content": name, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
        for name, token_id in SPECIAL_TOKENS
    ]
    return json.dumps(spec, ensure_ascii=False)


def tokenizer_config() -> dict:
    """`tokenizer_config.json` so transformers and vLLM find bos/eos/pad by name."""
    by_id = {token_id: name for name, token_id in SPECIAL_TOKENS}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": by_id[BOS_ID],
        "eos_token": by_id[EOS_ID],
        "pad_token": by_id[PAD_ID],
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 65536,
        "clean_up_tokenization_spaces": False,
    }
