"""Token usage from the engine's own counts.

deepseek-recipe counts completion tokens as it turns them into text (a token whose bytes do
not yet form a character waits for the next one, so a stream cut by `max_tokens` can report
one token less than the non-streamed reply) and `reasoning_tokens` in characters. The
service knows every token the engine generated, so the usage it sends is rewritten from
those: completion tokens as vLLM counts them (everything generated, the end token
included), reasoning tokens up to the end-of-thinking token (which is not reasoning)."""
from __future__ import annotations

import copy

_COMPLETION_KEYS = ("completion_tokens", "output_tokens")
_DETAIL_KEYS = ("completion_tokens_details", "output_tokens_details")
_PROMPT_KEYS = ("prompt_tokens", "input_tokens")
_USAGE_HOLDERS = (None, "response", "message")  # where each protocol's events carry usage


class TokenCounts:
    """The tokens each choice of one request generated, and how many were reasoning."""

    def __init__(self, choices: int, end_of_thinking: int | None):
        """`end_of_thinking`: the `</think>` id when the request thinks, else None."""
        self.end_of_thinking = end_of_thinking
        self.completion = [0] * choices
        self.reasoning = [0] * choices
        self._thinking = [end_of_thinking is not None] * choices

    def add(self, index: int, token_ids: list[int]) -> None:
        for token_id in token_ids:
            self.completion[index] += 1
            if self._thinking[index]:
                if token_id == self.end_of_thinking:
                    self._thinking[index] = False
                else:
                    self.reasoning[index] += 1

    def usage(self, usage: dict, index: int | None = None) -> dict:
        """The recipe's usage object with the counts of choice `index` (None: all choices,
        the prompt counted once); its shape and prompt figures are kept."""
        completion = sum(self.completion) if index is None else self.completion[index]
        reasoning = sum(self.reasoning) if index is None else self.reasoning[index]
        fixed = copy.deepcopy(usage)
        for key in _COMPLETION_KEYS:
            if key in fixed:
                fixed[key] = completion
        for key in _DETAIL_KEYS:
            if isinstance(fixed.get(key), dict) and "reasoning_tokens" in fixed[key]:
                fixed[key]["reasoning_tokens"] = reasoning
        if "total_tokens" in fixed:
            prompt = next((fixed[key] for key in _PROMPT_KEYS if key in fixed), 0)
            fixed["total_tokens"] = prompt + completion
        return fixed

    def rewrite(self, data: dict, index: int | None = None) -> dict:
        """`data` (a chunk, event or response as JSON) with every usage in it rewritten."""
        for holder_key in _USAGE_HOLDERS:
            holder = data if holder_key is None else data.get(holder_key)
            if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
                holder["usage"] = self.usage(holder["usage"], index)
        return data
