"""Engram's n-gram addressing: the compressed token vocabulary and the rolling hashes that
pick table rows. The gate that mixes the rows into the residual copies is in ops."""
from __future__ import annotations

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, normalizers

NO_TOKEN = -1
"""History entry for a position before the sequence start."""

_SPACE_SENTINEL = "\ue000"
_NORMALIZER = normalizers.Sequence([
    normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
    normalizers.Replace(Regex("[ \t\r\n]+"), " "),
    # A token that is exactly one space must survive the final strip.
    normalizers.Replace(Regex("^ $"), _SPACE_SENTINEL),
    normalizers.Strip(),
    normalizers.Replace(_SPACE_SENTINEL, " "),
])


def compressed_vocabulary(tokenizer: Tokenizer, vocab_size: int) -> tuple[torch.Tensor, int]:
    """Maps every token id to the id of its normalised text, numbered by first appearance
    in id order. Tokens that decode to a broken UTF-8 fragment keep their raw vocab string;
    tokens that normalise to nothing keep their decoded text."""
    table: dict[str, int] = {}
    lookup = torch.empty(vocab_size, dtype=torch.int64)
    for token_id in range(vocab_size):
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
    for d in range(2, int(n ** 0.5) + 1):
        if n % d == 0:
            return False
    return True


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
        bound = max(1, (2 ** 63 - 1) // compressed_vocab_size // 2)
        self.multipliers = {}
        self.primes = {}
        self.offsets = {}
        candidate = args.engram_vocab_size
        for layer in args.engram_layer_ids:
            rng = np.random.default_rng(10007 * layer)
            drawn = rng.integers(low=0, high=bound, size=(self.max_ngram,), dtype=np.int64)
            self.multipliers[layer] = torch.from_numpy(drawn * 2 + 1)
            primes = []
            for _ in range(args.engram_columns):
                while not _is_prime(candidate):
                    candidate += 1
                primes.append(candidate)
                candidate += 1
            self.primes[layer] = torch.tensor(primes, dtype=torch.int64)
            self.offsets[layer] = torch.tensor([0] + primes[:-1], dtype=torch.int64).cumsum(0)

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
