"""V4.1's Engram against upstream vLLM's V4.1 Engram (vllm/models/deepseek_v41/common/
engram.py).

Imported from upstream (pure Python/numpy, run as is):
* `compute_hash_multipliers` (:186-205) -- one odd int64 multiplier per (layer, shift);
* `EngramLayout` (:208-250) -- the prime bucket sizes per (layer, order, head) and each
  layer's offsets;
* `build_compressed_token_map` (:135-183) -- token id -> compressed id;
* `image_sentinel_mask` (vllm/models/deepseek_v41/common/mm_preprocess.py:54) -- which
  ids are image tokens.
Emulated from source (Triton kernels, no torch path upstream):
* `_hash_ids_kernel` (:288-420) -- the rolling hash and its padding rules;
* `_fused_engram_post_wkv_kernel` (:1186-1275) -- the gate, as Engram.forward
  (:1676-1740) drives it.

Image tokens (id 129264): upstream's model (nvidia/model.py:950-975) marks them dead for
the hash (an n-gram that reaches back through one is padded from there on) and shuts
their gate. The project API these cases use: `history_ids(compressed, token_ids)` turns
image tokens into NO_TOKEN history entries, `engram_gate(..., dead=image_tokens)` and
`V41Engram.forward(copies, table_rows, image_tokens)`.
"""

from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from helpers import upstream
from vllm_deepinfer.model.deepseek_v41.engram import (
    NO_TOKEN,
    EngramHashing,
    V41Engram,
    compressed_vocabulary,
    engram_gate,
    history_ids,
)

pytestmark = pytest.mark.unit

ENGRAM = "vllm.models.deepseek_v41.common.engram"
IMAGE_TOKEN = 129264
VOCAB = 129280
LAYERS, MAX_NGRAM, HEADS, HEAD_DIM = (1, 4), 4, 3, 32
ENGRAM_VOCAB = 2003  # bucket sizes are the primes from here on (2003 is one)
COMPRESSED_VOCAB, PAD_TOKEN = 5000, 2
HC, HIDDEN, EPS = 4, 32, 1e-6


def engram_config():
    """The config fields both sides read (upstream EngramLayout's and our EngramHashing's)."""
    return SimpleNamespace(
        engram_layer_ids=LAYERS,
        engram_max_ngram_size=MAX_NGRAM,
        engram_n_heads=HEADS,
        engram_head_dim=HEAD_DIM,
        engram_vocab_size=ENGRAM_VOCAB,
        engram_compressed_vocab_size=COMPRESSED_VOCAB,
        engram_pad_token_id=PAD_TOKEN,
        engram_num_embeddings=(0, 0),
        engram_ngram_orders=MAX_NGRAM - 1,
        engram_columns=(MAX_NGRAM - 1) * HEADS,
    )


def token_map(seed: int = 0) -> torch.Tensor:
    """A token id -> compressed id table over the full vocabulary (many-to-one)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, COMPRESSED_VOCAB, (VOCAB,), generator=g)


@pytest.fixture(scope="module")
def hashing_pair():
    lookup = token_map()
    pad_id = int(lookup[PAD_TOKEN])
    ours = EngramHashing(engram_config(), COMPRESSED_VOCAB, pad_id)
    layout = upstream(ENGRAM, "EngramLayout")(engram_config())
    multipliers = upstream(ENGRAM, "compute_hash_multipliers")(LAYERS, MAX_NGRAM, COMPRESSED_VOCAB)
    return ours, layout, multipliers, lookup, pad_id


# --- addressing parameters -------------------------------------------------------------
def test_hash_parameters_match_upstream_layout(hashing_pair):
    """Multipliers (per-layer PCG64 draws, made odd), prime bucket sizes (never reused,
    handed out by layer, order, head) and per-layer offsets are upstream's."""
    ours, layout, multipliers, _, _ = hashing_pair
    for index, layer in enumerate(LAYERS):
        assert torch.equal(ours.multipliers[layer], multipliers[index])
        primes = [p for order in layout.primes[index] for p in order]
        assert ours.primes[layer].tolist() == primes
        assert ours.offsets[layer].tolist() == layout.offsets[index].tolist()
        assert ours.rows_needed(layer) == sum(primes)
    assert (multipliers % 2 == 1).all()
    assert (
        len({p for layer in layout.primes for order in layer for p in order})
        == len(LAYERS) * (MAX_NGRAM - 1) * HEADS
    )


# --- the rolling hash: emulation of upstream's _hash_ids_kernel -----------------------
def _emulate_hash_ids(
    input_ids,
    positions,
    token_map,
    dead,
    lookback_ids,
    lookback_dead,
    multipliers,
    primes,
    offsets,
    pad_id,
):
    """[T, layers, orders * heads] hash ids of one request's chunk, as _hash_ids_kernel
    (engram.py:288-420) computes them without the V1 slot cache (cache=None):
    for shift s = 0 .. MAX_NGRAM-1 the id at position p - s comes from the chunk
    (p - s >= chunk start, :354-363), else from the runner's lookback window, column
    chunk_start - 1 - (p - s) (:365-382; -1 means unknown), else the pad id (:402-403);
    dead tokens (image positions, :360-363, :378-382) read as DEAD_ID. `blocked` turns on at
    the first shift that reaches before position 0 or hits a dead token and stays on
    (:407); blocked shifts contribute the pad id (:408); rolling ^= value * multiplier
    (:409-410); for s >= 1 column (s-1)*heads + h gets rolling % prime + offset
    (:411-420)."""
    dead_id = upstream(ENGRAM, "DEAD_ID")
    n_layers, n_ngram = multipliers.shape
    heads = primes.shape[-1]
    chunk_start = int(positions[0])
    out = torch.empty(len(input_ids), n_layers, (n_ngram - 1) * heads, dtype=torch.int64)
    for t in range(len(input_ids)):
        p = int(positions[t])
        for layer in range(n_layers):
            blocked, rolling = False, 0
            for s in range(n_ngram):
                back = p - s
                if back >= chunk_start:
                    source = dead_id if dead[t - s] else int(token_map[input_ids[t - s]])
                else:
                    col = chunk_start - 1 - back
                    token = int(lookback_ids[col]) if 0 <= col < len(lookback_ids) else -1
                    if token >= 0:
                        source = dead_id if lookback_dead[col] else int(token_map[token])
                    else:
                        source = pad_id
                blocked |= back < 0 or source == dead_id
                value = pad_id if blocked else source
                rolling ^= value * int(multipliers[layer, s])
                if s > 0:
                    for h in range(heads):
                        c = (s - 1) * heads + h
                        out[t, layer, c] = rolling % int(primes[layer, s - 1, h]) + int(
                            offsets[layer, c]
                        )
    return out


def ours_history(compressed: torch.Tensor) -> torch.Tensor:
    """[T, max_ngram] ids at p, p-1, ... (NO_TOKEN before the start), built from a whole
    sequence as ReferenceV41._engram / V41Model._ngram_history lay it out."""
    history = torch.full((len(compressed), MAX_NGRAM), NO_TOKEN, dtype=torch.int64)
    for back in range(MAX_NGRAM):
        history[back:, back] = compressed[: len(compressed) - back]
    return history


def upstream_rows(hashing_pair, ids, chunk_start=0, image=None):
    """Upstream's hashes of ids[chunk_start:], the earlier ids served as the runner's
    lookback window (most recent first, depth max_ngram - 1)."""
    _, layout, multipliers, lookup, pad_id = hashing_pair
    image = torch.zeros(len(ids), dtype=torch.bool) if image is None else image
    depth = MAX_NGRAM - 1
    lookback = torch.full((depth,), -1, dtype=torch.int64)
    lookback_dead = torch.zeros(depth, dtype=torch.bool)
    for col in range(depth):
        if chunk_start - 1 - col >= 0:
            lookback[col] = ids[chunk_start - 1 - col]
            lookback_dead[col] = image[chunk_start - 1 - col]
    return _emulate_hash_ids(
        ids[chunk_start:],
        torch.arange(chunk_start, len(ids)),
        lookup,
        image[chunk_start:],
        lookback,
        lookback_dead,
        multipliers,
        torch.tensor(layout.primes),
        layout.offsets,
        pad_id,
    )


def text_ids(seed: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128000, (length,), generator=g)
    ids[[4, 9]] = PAD_TOKEN  # a real pad token in the text must hash like any other id
    return ids


@pytest.mark.parametrize("chunk_start", [0, 5])
def test_rows_match_upstream_hash_kernel(hashing_pair, chunk_start):
    """Rolling hash, per-(order, head) buckets and offsets, pad ids for n-grams reaching
    before the start -- for a whole sequence, and for a chunk whose n-grams reach back
    into the runner's lookback window."""
    ours, *_, lookup, _ = hashing_pair
    ids = text_ids(1, 13)
    expected = upstream_rows(hashing_pair, ids, chunk_start)

    history = ours_history(lookup[ids])[chunk_start:]
    for index, layer in enumerate(LAYERS):
        assert torch.equal(ours.rows(layer, history), expected[:, index])
    assert not torch.equal(expected[:, 0], expected[:, 1])  # layers hash differently


def test_short_sequence_pads_every_order(hashing_pair):
    """Sequences shorter than the n-gram size: every order that reaches before the first
    token is padded (position 0's three orders, position 1's two longest, ...)."""
    ours, *_, lookup, _ = hashing_pair
    ids = torch.tensor([1000, 2000])
    expected = upstream_rows(hashing_pair, ids)
    history = ours_history(lookup[ids])
    for index, layer in enumerate(LAYERS):
        assert torch.equal(ours.rows(layer, history), expected[:, index])


def with_images(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = ids.clone()
    ids[[3, 6, 7]] = IMAGE_TOKEN  # a lone image token and a two-token span
    return ids, upstream("vllm.models.deepseek_v41.common.mm_preprocess", "image_sentinel_mask")(
        ids
    )


@pytest.mark.parametrize("chunk_start", [0, 5, 8])
def test_rows_with_image_tokens_match_upstream(hashing_pair, chunk_start):
    """Image positions are dead: their own rows are all-pad, and an n-gram reaching back
    through one is padded from there on -- also when the image token sits in the
    lookback window of a later chunk (chunk_start 8: positions 6 and 7 are images)."""
    ours, *_, lookup, _ = hashing_pair
    ids, image = with_images(text_ids(2, 13))
    expected = upstream_rows(hashing_pair, ids, chunk_start, image)

    history = ours_history(history_ids(lookup[ids], ids))[chunk_start:]
    for index, layer in enumerate(LAYERS):
        assert torch.equal(ours.rows(layer, history), expected[:, index])


# --- compressed vocabulary ---------------------------------------------------------------
def small_tokenizer() -> Tokenizer:
    """A byte-level BPE over text with case, accents, runs of spaces/tabs/newlines, CJK
    (so some byte tokens are partial UTF-8) and special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<bos>", "<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "The the THE tHe. Café cafe CAFÉ café naïve naive Naïve. Ångström angstrom.",
        "two  spaces, three   spaces,\ttab\t\ttabs\nnewline\n\n \n  indented",
        "ﬁne fine ＦＵＬＬ full ½ 1/2. 你好，世界。深度求索 深度 求索",
    ] * 6
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens(["<｜User｜>", "<｜Assistant｜>"])
    return tok


def test_compressed_vocabulary_matches_upstream_token_map():
    """Same compressed id for every token (normalisation: NFKC, NFD, accents stripped,
    lower case, whitespace runs collapsed, a lone space kept; partial UTF-8 tokens keyed
    by their raw form) and the same count."""
    build = upstream(ENGRAM, "build_compressed_token_map")
    from transformers import PreTrainedTokenizerFast

    tok = small_tokenizer()
    length = tok.get_vocab_size(with_added_tokens=True)
    expected, expected_count = build(PreTrainedTokenizerFast(tokenizer_object=tok))

    ours, count = compressed_vocabulary(tok, length + 3)
    assert count == expected_count
    assert ours[:length].tolist() == expected
    assert count < length  # normalisation did merge tokens
    assert (ours[length:] == NO_TOKEN).all()  # rows past the tokenizer (the project's rule)


# --- the gate: emulation of upstream's _fused_engram_post_wkv_kernel ---------------------
def _emulate_engram_gate(hidden, kv, q_weight, k_weight, token_mask=None, clamp=1e-6):
    """_fused_engram_post_wkv_kernel (engram.py:1186-1275), one program per (token, copy):
    key = kv[t, copy*D:(copy+1)*D], value = kv[t, hc*D:] (:1231-1235, :1262-1266);
    dot = sum(h * q * k * key) * rsqrt(mean h^2 + eps) * rsqrt(mean key^2 + eps) / sqrt(D)
    (:1247-1250); gate = sigmoid(sign(dot) * sqrt(max(|dot|, clamp))) with sign - only for
    dot < 0 (:1251-1253); a token whose mask is False gets gate 0 (:1254-1260);
    out = h + gate * value (:1267-1275). clamp is Engram.clamp_value = 1e-6 (:1545)."""
    t, hc, d = hidden.shape
    key = kv[:, : hc * d].view(t, hc, d)
    value = kv[:, hc * d :]
    hidden_rms = torch.rsqrt(hidden.pow(2).mean(-1) + EPS)
    key_rms = torch.rsqrt(key.pow(2).mean(-1) + EPS)
    dot = (hidden * q_weight * k_weight * key).sum(-1) * hidden_rms * key_rms / d**0.5
    gate_in = dot.abs().clamp_min(clamp).sqrt()
    gate = torch.sigmoid(torch.where(dot < 0, -gate_in, gate_in))
    if token_mask is not None:
        gate = torch.where(token_mask[:, None], gate, torch.zeros_like(gate))
    return hidden + gate[..., None] * value[:, None, :]


def gate_inputs(seed: int, t: int = 12):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, HC, HIDDEN, generator=g, dtype=torch.float64) * 2
    kv = torch.randn(t, (HC + 1) * HIDDEN, generator=g, dtype=torch.float64)
    kv[0, :HIDDEN] = 0.0  # a zero key: dot exactly 0, the clamp decides the gate
    q_weight = torch.randn(HC, HIDDEN, generator=g, dtype=torch.float64)
    k_weight = torch.randn(HC, HIDDEN, generator=g, dtype=torch.float64)
    return hidden, kv, q_weight, k_weight


@torch.no_grad()
def test_gate_matches_upstream_kernel():
    """Per-copy keys, the shared value, q/k weights, signed square root with its clamp
    (gates above and below 1/2 both occur)."""
    hidden, kv, q_weight, k_weight = gate_inputs(3)
    expected = _emulate_engram_gate(hidden, kv, q_weight, k_weight)
    keys = kv[:, : HC * HIDDEN].view(-1, HC, HIDDEN)
    ours = engram_gate(hidden, keys, kv[:, HC * HIDDEN :], q_weight, k_weight, EPS)
    torch.testing.assert_close(ours, expected, atol=1e-12, rtol=0)
    gates = (expected - hidden)[..., 0] / kv[:, None, HC * HIDDEN]
    assert (gates < 0.5).any() and (gates > 0.5).any()


@torch.no_grad()
def test_gate_with_image_tokens_matches_upstream():
    """Image tokens pass through untouched (upstream's token_mask = ~image_mask)."""
    hidden, kv, q_weight, k_weight = gate_inputs(4)
    image = torch.zeros(hidden.shape[0], dtype=torch.bool)
    image[[2, 5, 6]] = True
    expected = _emulate_engram_gate(hidden, kv, q_weight, k_weight, token_mask=~image)
    keys = kv[:, : HC * HIDDEN].view(-1, HC, HIDDEN)
    ours = engram_gate(hidden, keys, kv[:, HC * HIDDEN :], q_weight, k_weight, EPS, dead=image)
    torch.testing.assert_close(ours, expected, atol=1e-12, rtol=0)
    assert torch.equal(ours[image], hidden[image])


# --- the module: rows -> embedding -> wkv -> gate, as upstream's Engram.forward ---------
def engram_module(hashing_pair, seed: int):
    """V41Engram's parameters around its own lookup and gate. Its `wkv` is a vLLM
    ReplicatedLinear, which needs an initialised tensor-parallel group; a plain matmul with
    the same weight stands in for it, so V41Engram's lookup (`lookup_step`, which the
    layer op calls) and gate (`gated`) run unbound on this namespace, on a table held in
    memory instead of mapped from a checkpoint."""
    rows = hashing_pair[0].rows_needed(LAYERS[0])
    a = SimpleNamespace(
        engram_layer_ids=LAYERS,
        engram_num_embeddings=(rows, rows),
        engram_head_dim=HEAD_DIM,
        engram_columns=(MAX_NGRAM - 1) * HEADS,
        hc_mult=HC,
        hidden_size=HIDDEN,
        rms_norm_eps=EPS,
    )
    g = torch.Generator().manual_seed(seed)
    n_in = a.engram_columns * HEAD_DIM
    embed = torch.nn.Embedding(rows, HEAD_DIM).double().requires_grad_(False)
    embed.weight.copy_(torch.randn(embed.weight.shape, generator=g, dtype=torch.float64))
    wkv = torch.randn((HC + 1) * HIDDEN, n_in, generator=g, dtype=torch.float64) / n_in**0.5
    # One tensor-parallel rank: every column and the whole table.
    module = SimpleNamespace(
        a=a,
        layer=LAYERS[0],
        embed=embed,
        table=embed.weight,
        table_scale=None,
        wkv=lambda x: x @ wkv.T,
        columns=slice(0, a.engram_columns),
        first_row=0,
        tensor_parallel=False,
        wkv_weight=wkv,
        q_weight=torch.randn(HC, HIDDEN, generator=g, dtype=torch.float64),
        k_weight=torch.randn(HC, HIDDEN, generator=g, dtype=torch.float64),
    )

    def forward(copies, table_rows, image_tokens):
        looked_up = copies.new_empty(copies.shape[0], a.engram_columns, HEAD_DIM)
        V41Engram.lookup_step(module, table_rows, looked_up)
        return V41Engram.gated(module, copies, looked_up, image_tokens)

    module.forward = forward
    return module


def upstream_engram_forward(module, hidden, hash_ids, token_mask=None):
    """Engram.forward (engram.py:1676-1740) without staging/TP: kv =
    wkv(embed(hash_ids).flatten(-2)), then the fused gate kernel."""
    kv = module.embed.weight[hash_ids].flatten(-2) @ module.wkv_weight.T
    return _emulate_engram_gate(hidden, kv, module.q_weight, module.k_weight, token_mask)


@torch.no_grad()
def test_engram_module_matches_upstream_forward(hashing_pair):
    ours_hashing, *_, lookup, _ = hashing_pair
    module = engram_module(hashing_pair, 5)
    ids = text_ids(5, 12)
    rows = ours_hashing.rows(LAYERS[0], ours_history(lookup[ids]))
    hidden = torch.randn(
        12, HC, HIDDEN, generator=torch.Generator().manual_seed(6), dtype=torch.float64
    )
    expected = upstream_engram_forward(module, hidden, rows)
    torch.testing.assert_close(module.forward(hidden, rows, None), expected, atol=1e-12, rtol=0)


@torch.no_grad()
def test_engram_module_with_image_tokens_matches_upstream(hashing_pair):
    """Token ids with image tokens end to end: history (history_ids), rows, module with
    the image mask, against upstream's dead-token hashes and masked gate."""
    ours_hashing, *_, lookup, _ = hashing_pair
    module = engram_module(hashing_pair, 7)
    ids, image = with_images(text_ids(7, 12))
    hidden = torch.randn(
        12, HC, HIDDEN, generator=torch.Generator().manual_seed(8), dtype=torch.float64
    )
    expected = upstream_engram_forward(
        module, hidden, upstream_rows(hashing_pair, ids, image=image)[:, 0], token_mask=~image
    )
    rows = ours_hashing.rows(LAYERS[0], ours_history(history_ids(lookup[ids], ids)))
    torch.testing.assert_close(module.forward(hidden, rows, image), expected, atol=1e-12, rtol=0)
