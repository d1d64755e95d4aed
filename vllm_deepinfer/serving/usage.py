"""Token usage from the engine's own counts.

deepseek-recipe counts completion tokens as it turns them into text (a token whose bytes do
not yet form a character waits for the next one, so a stream cut by `max_tokens` can report
one token less than the non-streamed reply) and `reasoning_tokens` in characters. The
service knows every token the engine generated, so the usage it sends is rewritten from
those: completion tokens as vLLM counts them (everything generated, the end token
included), reasoning tokens up to the end-of-thinking token (which is not reasoning).

Prompt-cache hits. The prompt side comes from the engine too: `prompt_cache_hit_tokens`
(`prompt_cache_hits`) is the prompt tokens the engine did not compute, read from the
prefix cache (local, or loaded by a KV connector such as the context cache). vLLM's
`num_cached_tokens` is the hit as found, before bounded replay rewinds it: the hit's last
`keep` tokens (DEEPINFER_YOCO_PREFILL_KEEP_TOKENS, 140 by default; 0 in exact mode) are
recomputed to rebuild the sliding-window KV, which is not cached. Those tokens cost a
prefill like any other, so they are not hits: a request reports `num_cached_tokens -
min(num_cached_tokens, keep)`, the rule vLLM's scheduler applies to it
(`Scheduler._mark_prefix_replay`) and the figure `deepinfer:prefix_saved_tokens` sums on
/metrics. The API server knows `keep` from the config (kv_cache/replay_metrics.py); the
scheduler's one exception, a KV load that restores the window (replays nothing), does
not occur with bounded replay on under the plugin's context cache: it offloads the
prefix-cacheable groups, which include the window only in exact mode (keep 0). Hits of at
most `keep` tokens are dropped by the scheduler (recomputed whole) and read 0 already. A
KV load that fails and is recomputed stays counted as vLLM counted it at admission
(vLLM does not revise the figure, and the API server sees no more).

Each protocol reports the hits in its own shape, as deepseek-recipe writes its usage from
them: Chat Completions `prompt_cache_hit_tokens` and `prompt_cache_miss_tokens` (DeepSeek's;
they sum to `prompt_tokens`) and `prompt_tokens_details.cached_tokens` (OpenAI's, = hits);
Responses `input_tokens_details.cached_tokens` (`input_tokens` is the whole prompt);
Messages `cache_read_input_tokens` with Anthropic's `input_tokens`, the prompt tokens
*not* read from the cache (input_tokens + cache_read_input_tokens = the prompt), and
`cache_creation_input_tokens` 0 (caching is automatic: no request pays to write it)."""

from __future__ import annotations

import copy

_COMPLETION_KEYS = ("completion_tokens", "output_tokens")
_DETAIL_KEYS = ("completion_tokens_details", "output_tokens_details")
_PROMPT_KEYS = ("prompt_tokens", "input_tokens")
_USAGE_HOLDERS = (None, "response", "message")  # where each protocol's events carry usage


def prompt_cache_hits(num_cached_tokens: int | None, replay_keep: int, prompt_tokens: int) -> int:
    """The prompt tokens a request read from the prefix cache and did not recompute:
    vLLM's `num_cached_tokens` less the `replay_keep` tokens bounded replay recomputed
    (module docstring), at most the prompt."""
    hit = num_cached_tokens or 0
    return max(0, min(hit - min(hit, replay_keep), prompt_tokens))


def served_replay_keep(engine_client) -> int:
    """The tokens bounded replay recomputes of each prefix hit on the engine behind
    `engine_client` (0: exact mode, another model, or no engine config)."""
    vllm_config = getattr(engine_client, "vllm_config", None)
    if vllm_config is None:
        return 0
    from vllm_deepinfer.model.deepseek_v41.registration import replay_keep

    return replay_keep(vllm_config)


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
