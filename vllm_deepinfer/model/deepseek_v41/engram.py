"""Engram, V4.1's hashed n-gram memory: token ids map to a compressed vocabulary of
normalised text; for each position a rolling hash over the last 2..N compressed ids picks,
per (order, head), one row of a large table; `wkv` of the rows gives one key per residual
copy and a shared value, and each copy gates the value in by a signed-sqrt sigmoid of its
normalised dot with its key."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
from tokenizers import Regex, Tokenizer, normalizers
from vllm.distributed import tensor_model_parallel_all_gather

from vllm_deepinfer.checkpoint.mapped import mapped_tensor
from vllm_deepinfer.checkpoint.mx_formats import dequantize_rowwise_fp8
from vllm_deepinfer.determinism import batch_invariant
from vllm_deepinfer.model.deepseek_v41 import layer_ops
from vllm_deepinfer.model.deepseek_v41.args import IMAGE_TOKEN_ID, V41Args
from vllm_deepinfer.model.deepseek_v41.layer_ops import register_owner
from vllm_deepinfer.model.deepseek_v41.ops import linear, rms_norm, wide
from vllm_deepinfer.model.deepseek_v41.parallel import TensorSplit

NO_TOKEN = -1
"""History entry that blocks an n-gram there and before: a position before the sequence
start, an image token, or an id the tokenizer does not have."""

_SPACE_SENTINEL = "\ue000"
_NORMALIZER = normalizers.Sequence(
    [
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex("[ \t\r\n]+"), " "),
        # A token that is exactly one space must survive the final strip.
        normalizers.Replace(Regex("^ $"), _SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SPACE_SENTINEL, " "),
    ]
)


class EngramVocabularyError(ValueError):
    """The tokenizer does not fit the config's vocabulary or Engram sizes."""


def compressed_vocabulary(tokenizer: Tokenizer, vocab_size: int) -> tuple[torch.Tensor, int]:
    """Maps every id of the tokenizer (its own length, not the config's vocab_size) to the
    id of its normalised text, numbered by first appearance in id order. Tokens that
    decode to a broken UTF-8 fragment keep their raw vocab string; tokens that normalise
    to nothing keep their decoded text. Embedding rows past the tokenizer's length map to
    NO_TOKEN. Returns (lookup [vocab_size], number of compressed ids)."""
    length = tokenizer.get_vocab_size(with_added_tokens=True)
    if length > vocab_size:
        raise EngramVocabularyError(
            f"the tokenizer has {length} tokens but the config's vocab_size is {vocab_size}"
        )
    table: dict[str, int] = {}
    lookup = torch.full((vocab_size,), NO_TOKEN, dtype=torch.int64)
    for token_id in range(length):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = _NORMALIZER.normalize_str(text) or text
        lookup[token_id] = table.setdefault(key, len(table))
    return lookup, len(table)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % d for d in range(2, int(n**0.5) + 1))


def column_buckets(args) -> dict[int, torch.Tensor]:
    """Each Engram layer's bucket sizes, one prime per (order, head) column: consecutive
    primes from engram_vocab_size, handed out by layer, order, head."""
    buckets, candidate = {}, args.engram_vocab_size
    for layer in args.engram_layer_ids:
        primes = []
        for _ in range(args.engram_columns):
            while not _is_prime(candidate):
                candidate += 1
            primes.append(candidate)
            candidate += 1
        buckets[layer] = torch.tensor(primes, dtype=torch.int64)
    return buckets


def first_rows(primes: torch.Tensor) -> torch.Tensor:
    """The first table row of each column: the columns' ranges laid end to end."""
    return torch.cat([primes.new_zeros(1), primes[:-1]]).cumsum(0)


class EngramHashing:
    """Table rows of every (order, head) column for each Engram layer.

    Multipliers are odd int64s from a numpy PCG64 stream seeded per layer; each column
    hashes into its own prime-sized bucket range (consecutive primes from
    engram_vocab_size, handed out by layer, order, head), laid end to end per layer.
    """

    def __init__(self, args, compressed_vocab_size: int, pad_compressed_id: int):
        self.max_ngram = args.engram_max_ngram_size
        self.n_heads = args.engram_n_heads
        self.pad_id = pad_compressed_id
        bound = max(1, (2**63 - 1) // compressed_vocab_size // 2)
        self.multipliers = {}
        self.primes = column_buckets(args)
        self.offsets = {layer: first_rows(primes) for layer, primes in self.primes.items()}
        for layer in args.engram_layer_ids:
            rng = np.random.default_rng(10007 * layer)
            drawn = rng.integers(low=0, high=bound, size=(self.max_ngram,), dtype=np.int64)
            self.multipliers[layer] = torch.from_numpy(drawn * 2 + 1)

    def to(self, device: torch.device) -> EngramHashing:
        """Moves the hash constants to the model's device."""
        for table in (self.multipliers, self.primes, self.offsets):
            for layer, values in table.items():
                table[layer] = values.to(device)
        return self

    def rows_needed(self, layer: int) -> int:
        return int(self.primes[layer].sum())

    def rows(self, layer: int, history: torch.Tensor) -> torch.Tensor:
        """history [T, max_ngram]: compressed ids at p, p-1, ... (NO_TOKEN before the start).
        Returns table rows [T, orders * heads], order-major."""
        blocked = (history == NO_TOKEN).to(torch.int64).cummax(dim=1).values.bool()
        ids = torch.where(blocked, torch.full_like(history, self.pad_id), history)
        mixed = ids * self.multipliers[layer][None, :]
        hashes = [mixed[:, 0]]
        for s in range(1, self.max_ngram):
            hashes.append(hashes[-1] ^ mixed[:, s])
        per_order = torch.stack(hashes[1:], dim=1)  # [T, orders]
        per_column = per_order.repeat_interleave(self.n_heads, dim=1)
        return per_column % self.primes[layer] + self.offsets[layer]


def engram_addressing(tokenizer: Tokenizer, a: V41Args) -> tuple[torch.Tensor, EngramHashing]:
    """The compressed-id lookup and the hashing of a checkpoint, checked against its config."""
    compressed, count = compressed_vocabulary(tokenizer, a.vocab_size)
    if count != a.engram_compressed_vocab_size:
        raise EngramVocabularyError(
            f"the tokenizer normalises to {count} Engram ids, but the config says "
            f"engram_compressed_vocab_size={a.engram_compressed_vocab_size}"
        )
    hashing = EngramHashing(a, count, int(compressed[a.engram_pad_token_id]))
    for layer, rows in zip(a.engram_layer_ids, a.engram_num_embeddings):
        if hashing.rows_needed(layer) > rows:
            raise EngramVocabularyError(
                f"Engram layer {layer} hashes into "
                f"{hashing.rows_needed(layer)} rows but "
                f"engram_num_embeddings gives {rows}"
            )
    return compressed, hashing


def history_ids(compressed: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Compressed ids as they enter the n-gram history: image tokens are NO_TOKEN."""
    return torch.where(token_ids == IMAGE_TOKEN_ID, NO_TOKEN, compressed)


def engram_gate(
    copies: torch.Tensor,
    keys: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    dead: torch.Tensor | None = None,
) -> torch.Tensor:
    """copies [T, hc, H], keys [T, hc, H], value [T, H]: each copy gates the shared value
    by a signed-sqrt sigmoid of its normalised dot with its own key; `dead` [T] (image
    tokens) gets a zero gate."""
    h = copies.shape[-1]
    x = rms_norm(wide(copies), None, eps) * wide(q_weight)
    k = rms_norm(wide(keys), None, eps) * wide(k_weight)
    dot = (x * k).sum(-1) / math.sqrt(h)
    sign = torch.where(dot >= 0, 1.0, -1.0)
    gate = batch_invariant.pointwise(torch.sigmoid, sign * dot.abs().clamp_min(1e-6).sqrt())
    if dead is not None:
        gate = gate.masked_fill(dead[:, None], 0.0)
    return (wide(copies) + gate[..., None] * wide(value)[:, None, :]).to(copies.dtype)


class V41Engram(nn.Module):
    """The table is read in place from the checkpoint through a memory map
    (checkpoint/mapped.py), a few rows per token, decoded to the model dtype as looked up
    (the release stores it as FP8 rows with per-32 UE8M0 scales); its resident cost is
    the pages recently read. Under tensor parallelism each rank maps the table rows of
    its share of the (order, head) columns (contiguous: the columns' ranges lie end to
    end), looks up those columns and all-gathers the others' before `wkv`, which every
    rank holds whole."""

    def __init__(self, a: V41Args, layer: int, prefix: str):
        super().__init__()
        self.a, self.layer = a, layer
        split = TensorSplit.current()
        self.rows = a.engram_num_embeddings[a.engram_layer_ids.index(layer)]
        self.tensor_parallel = split.size > 1
        columns = split.part(a.engram_columns, "Engram columns (n-gram orders x heads)")
        self.columns = slice(split.rank * columns, (split.rank + 1) * columns)
        self.first_row = 0
        if self.tensor_parallel:
            primes = column_buckets(a)[layer]
            self.first_row = int(first_rows(primes)[self.columns.start])
            self.rows = int(primes[self.columns].sum())
        # This rank's rows of the mapped table and, for FP8 rows, their scales (map_table).
        self.table: torch.Tensor | None = None
        self.table_scale: torch.Tensor | None = None
        self.wkv = linear(
            a.engram_columns * a.engram_head_dim,
            (a.hc_mult + 1) * a.hidden_size,
            f"{prefix}.wkv",
            quantized=True,
        )
        self.q_weight = nn.Parameter(torch.empty(a.hc_mult, a.hidden_size), requires_grad=False)
        self.k_weight = nn.Parameter(torch.empty(a.hc_mult, a.hidden_size), requires_grad=False)
        self.op_name = register_owner(prefix, self)

    def map_table(self, checkpoint_dir: str, name: str, scaled: bool) -> None:
        """Maps this rank's rows of checkpoint table `name` (and its `.scale` where
        `scaled`); nothing is read until a lookup touches a row."""

        def mine(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.narrow(0, self.first_row, self.rows)

        self.table = mine(mapped_tensor(checkpoint_dir, name))
        if scaled:
            scale_name = name[: -len(".weight")] + ".scale"
            self.table_scale = mine(mapped_tensor(checkpoint_dir, scale_name)).view(torch.uint8)

    def lookup_step(self, table_rows: torch.Tensor, out: torch.Tensor) -> None:
        """The layer op (layer_ops.py): `out` [T, columns, head_dim] gets this rank's
        columns' rows, decoded to out's dtype."""
        if self.table is None:
            raise RuntimeError("Engram table looked up before the checkpoint mapped it")
        rows = (table_rows[:, self.columns] - self.first_row).flatten()
        values = self.table.index_select(0, rows)
        if self.table_scale is not None:
            values = dequantize_rowwise_fp8(values, self.table_scale.index_select(0, rows))
        out.copy_(values.view(out.shape))

    def forward(
        self, copies: torch.Tensor, table_rows: torch.Tensor, image_tokens: torch.Tensor
    ) -> torch.Tensor:
        columns = self.columns.stop - self.columns.start
        looked_up = copies.new_empty(copies.shape[0], columns, self.a.engram_head_dim)
        layer_ops.engram_rows(table_rows, looked_up, self.op_name)
        return self.gated(copies, looked_up, image_tokens)

    def gated(
        self, copies: torch.Tensor, looked_up: torch.Tensor, image_tokens: torch.Tensor | None
    ) -> torch.Tensor:
        """The copies after Engram, from this rank's looked-up rows [T, columns, head_dim]."""
        hc, h = self.a.hc_mult, self.a.hidden_size
        if self.tensor_parallel:
            looked_up = tensor_model_parallel_all_gather(looked_up, dim=1)
        projected = self.wkv(looked_up.flatten(1))
        keys = projected[:, : hc * h].view(-1, hc, h)
        return engram_gate(
            copies,
            keys,
            projected[:, hc * h :],
            self.q_weight,
            self.k_weight,
            self.a.rms_norm_eps,
            dead=image_tokens,
        )
