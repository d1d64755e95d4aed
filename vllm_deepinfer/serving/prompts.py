"""Injection-safe prompt encoding, with long prompts tokenized in parallel.

deepseek-recipe renders a conversation and marks the spans that hold template-emitted
special tokens; only those become special ids, and the text between them is encoded
without the added vocabulary, so user text that spells `<｜User｜>` stays text.

For long prompts the plain text is cut into pieces and the pieces are encoded together
by the `tokenizers` library's batch encoder, which runs on all cores. Cuts fall only at
special-token spans and at pre-token boundaries of the tokenizer's own pre-tokenizer:
BPE never merges across those, so the concatenation equals sequential encoding.
"""

from __future__ import annotations

import json
import os

import deepseek_recipe as dr
from tokenizers import Tokenizer

PARALLEL_MIN_CHARS = 16_384
"""The parallel path runs when some plain-text run between special tokens is at least
this long; many shorter runs are encoded as fast by the recipe's sequential encoder
(measured by benchmarks/tokenization.py)."""
PIECE_CHARS = 8_192
"""Target length of the plain-text pieces encoded in parallel."""
_WINDOW = 64
"""Characters pre-tokenized on each side of a candidate cut."""


def _plain_text_tokenizer(tokenizer_json: str) -> Tokenizer:
    """The tokenizer without its added vocabulary: special spellings encode as text."""
    spec = json.loads(tokenizer_json)
    spec["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(spec))


class PromptEncoder:
    def __init__(self, tokenizer_dir: str):
        with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
            tokenizer_json = f.read()
        self.recipe_tokenizer = dr.Tokenizer.from_str(tokenizer_json)
        self.encoding = dr.DeepseekV41Encoding().with_tokenizer(self.recipe_tokenizer)
        self._full = Tokenizer.from_str(tokenizer_json)
        self._plain = _plain_text_tokenizer(tokenizer_json)

    def encode(self, conversation, rendered=None) -> list[int]:
        """Prompt ids; `rendered` is the conversation's render, when the caller has it."""
        rendered = rendered or self.encoding.render_conversation(conversation)
        spans = [b for span in rendered.special_ranges for b in span]
        bounds = [0, *spans, len(rendered.prompt)]
        longest_text = max(end - start for start, end in zip(bounds[::2], bounds[1::2]))
        if longest_text < PARALLEL_MIN_CHARS:
            return self.encoding.encode(conversation)
        return self.encode_rendered(rendered.prompt, rendered.special_ranges)

    def token_id(self, text: str) -> int | None:
        """The id of a special token such as `</think>` (None when the tokenizer lacks it)."""
        return self._full.token_to_id(text)

    def encode_sequential(self, conversation) -> list[int]:
        return self.encoding.encode(conversation)

    def encode_rendered(self, prompt: str, special_ranges: list[tuple[int, int]]) -> list[int]:
        """Special spans by id lookup, plain text in parallel pieces."""
        parts: list[int | str] = []  # a special id, or a piece of plain text
        cursor = 0
        for start, end in special_ranges:
            parts.extend(self._pieces(prompt[cursor:start]))
            token_id = self._full.token_to_id(prompt[start:end])
            if token_id is None:
                raise ValueError(
                    f"the template emitted {prompt[start:end]!r}, which the tokenizer does not know"
                )
            parts.append(token_id)
            cursor = end
        parts.extend(self._pieces(prompt[cursor:]))
        texts = [p for p in parts if isinstance(p, str)]
        encoded = iter(self._plain.encode_batch_fast(texts, add_special_tokens=False))
        ids: list[int] = []
        for part in parts:
            ids.extend(next(encoded).ids if isinstance(part, str) else [part])
        return ids

    def _pieces(self, text: str) -> list[str]:
        """Cuts text into ~PIECE_CHARS pieces at pre-token boundaries."""
        cuts = [0]
        target = PIECE_CHARS
        while target < len(text) - PIECE_CHARS // 2:
            cut = self._boundary_near(text, target)
            if cut is not None and cut > cuts[-1]:
                cuts.append(cut)
            target += PIECE_CHARS
        cuts.append(len(text))
        return [text[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]

    def _boundary_near(self, text: str, position: int) -> int | None:
        """A pre-token boundary close to `position`, found by pre-tokenizing two windows
        that overlap around it: regex pre-tokenizers look only a few characters ahead,
        so a boundary that both windows agree on, far from their edges, is one of the
        whole text too."""

        def boundaries(lo: int, hi: int) -> set[int]:
            spans = self._plain.pre_tokenizer.pre_tokenize_str(text[lo:hi])
            return {lo + start for _, (start, _) in spans}

        shared = boundaries(position - _WINDOW, position + _WINDOW) & boundaries(
            position - _WINDOW // 2, position + 2 * _WINDOW
        )
        inner = [b for b in shared if abs(b - position) < _WINDOW // 4]
        return min(inner, key=lambda b: abs(b - position)) if inner else None
