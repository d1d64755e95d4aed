"""Usage from the engine's token counts, in each protocol's own shape."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from vllm_deepinfer.serving.chat_service import ChatService
from vllm_deepinfer.serving.frontend import _sse
from vllm_deepinfer.serving.prompts import PromptEncoder
from vllm_deepinfer.serving.protocols import CHAT, MESSAGES, RESPONSES
from vllm_deepinfer.serving.usage import TokenCounts, prompt_cache_hits, served_replay_keep

pytestmark = pytest.mark.unit
END = 7  # </think>


def test_reasoning_counts_tokens_up_to_the_end_of_thinking():
    counts = TokenCounts(1, END)
    counts.add(0, [1, 2, 3])
    counts.add(0, [END, 4, 5])
    assert counts.completion == [6] and counts.reasoning == [3]


def test_without_thinking_nothing_is_reasoning():
    counts = TokenCounts(1, None)
    counts.add(0, [1, END, 2])
    assert counts.completion == [3] and counts.reasoning == [0]


def test_chat_usage_rewritten_in_place_of_the_recipes():
    counts = TokenCounts(2, END)
    counts.add(0, [1, 2, END, 3])
    counts.add(1, [4, 5, 6])
    recipe = {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 93},
        "prompt_cache_hit_tokens": 4,
        "prompt_cache_miss_tokens": 6,
    }
    assert counts.usage(recipe, 0) == {
        **recipe,
        "completion_tokens": 4,
        "total_tokens": 14,
        "completion_tokens_details": {"reasoning_tokens": 2},
    }
    assert counts.usage(recipe) == {
        **recipe,
        "completion_tokens": 7,
        "total_tokens": 17,
        "completion_tokens_details": {"reasoning_tokens": 5},
    }
    assert recipe["completion_tokens"] == 3  # the recipe's object is not changed


def test_responses_and_messages_events_rewritten_where_they_hold_usage():
    counts = TokenCounts(1, None)
    counts.add(0, [1, 2, 3, 4])
    responses = {
        "type": "response.completed",
        "response": {
            "usage": {
                "input_tokens": 9,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": 3,
                "output_tokens_details": {"reasoning_tokens": 12},
                "total_tokens": 12,
            }
        },
    }
    assert counts.rewrite(responses)["response"]["usage"] == {
        "input_tokens": 9,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 13,
    }
    delta = {
        "type": "message_delta",
        "usage": {"input_tokens": 5, "output_tokens": 3, "cache_read_input_tokens": 4},
    }
    assert counts.rewrite(delta)["usage"] == {
        "input_tokens": 5,
        "output_tokens": 4,
        "cache_read_input_tokens": 4,
    }
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 5, "output_tokens": 0}}}
    assert counts.rewrite(start)["message"]["usage"]["output_tokens"] == 4
    assert counts.rewrite({"type": "content_block_delta"}) == {"type": "content_block_delta"}


# --- prompt-cache hits (usage.py's rule; the protocols' shapes through the recipe) -----


@pytest.mark.parametrize(
    "cached,keep,prompt,hits",
    [
        (None, 140, 300, 0),
        (0, 140, 300, 0),
        (288, 140, 300, 148),  # a hit: its last `keep` tokens were recomputed, not read
        (288, 0, 300, 288),  # exact mode: nothing replayed
        (96, 140, 300, 0),  # shorter than keep (the scheduler drops such hits anyway)
        (400, 0, 300, 300),  # never more than the prompt
    ],
)
def test_prompt_cache_hits_leave_out_replayed_tokens(cached, keep, prompt, hits):
    assert prompt_cache_hits(cached, keep, prompt) == hits


def test_no_engine_config_means_no_replay():
    assert served_replay_keep(None) == 0 == served_replay_keep(SimpleNamespace())


class CachedEngine:
    """An engine that answers `ANSWER` and says `cached` prompt tokens were prefix hits."""

    def __init__(self, cached: int):
        self.cached = cached

    async def generate(self, prompt, params, request_id, **_):
        for i, token in enumerate(ANSWER):
            last = i == len(ANSWER) - 1
            yield SimpleNamespace(
                finished=last,
                num_cached_tokens=self.cached,
                kv_transfer_params=None,
                outputs=[
                    SimpleNamespace(
                        index=0,
                        token_ids=[token],
                        logprobs=None,
                        stop_reason=None,
                        finish_reason="length" if last else None,
                    )
                ],
            )

    async def abort(self, request_id):
        pass


ANSWER = list(range(300, 306))
CACHED, KEEP = 80, 16  # the engine's figure and the replay: 64 tokens read, not computed
SYSTEM = "You answer in riddles. " * 20
HELLO = [{"role": "user", "content": "Hello"}]
BODIES = {
    CHAT: {
        "model": "tiny",
        "max_tokens": 6,
        "thinking": {"type": "disabled"},
        "messages": [{"role": "system", "content": SYSTEM}, *HELLO],
    },
    RESPONSES: {"model": "tiny", "max_output_tokens": 6, "instructions": SYSTEM, "input": "Hello"},
    MESSAGES: {
        "model": "tiny",
        "max_tokens": 6,
        "thinking": {"type": "disabled"},
        "system": SYSTEM,
        "messages": HELLO,
    },
}


@pytest.fixture(scope="module")
def cached_service(tiny_checkpoint):
    service = ChatService(CachedEngine(CACHED), PromptEncoder(tiny_checkpoint), ["tiny"], 4096)
    service.replay_keep = KEEP
    return service


def served_usage(service, protocol, stream: bool) -> tuple[dict, int]:
    """The usage of the reply as the front end sends it (streamed: the last usage the
    stream carries), and the prompt's length."""
    body = {**BODIES[protocol], "stream": stream}
    if stream and protocol is CHAT:
        body["stream_options"] = {"include_usage": True}
    prepared = service.prepare(protocol, json.dumps(body).encode(), "application/json")

    async def reply():
        events = service.events(prepared)
        if stream:
            return "".join([part async for part in _sse(protocol, None, events)])
        response = service.aggregate(prepared)
        async for event in events:
            response.accumulate(event)
        return response.to_json()

    sent = asyncio.run(reply())
    if not stream:
        return json.loads(sent)["usage"], prepared.prompt_length
    usages = []
    for line in sent.splitlines():
        if line.startswith("data: {"):
            data = json.loads(line[len("data: ") :])
            holder = data.get("response") or data.get("message") or data
            if holder.get("usage"):
                usages.append(holder["usage"])
    return usages[-1], prepared.prompt_length


@pytest.mark.parametrize("protocol", [CHAT, RESPONSES, MESSAGES], ids=lambda p: p.path)
def test_cache_hits_in_each_protocols_usage_streamed_or_not(cached_service, protocol):
    whole, prompt = served_usage(cached_service, protocol, stream=False)
    streamed, _ = served_usage(cached_service, protocol, stream=True)
    assert streamed == whole
    hits = CACHED - KEEP
    assert prompt > CACHED
    if protocol is CHAT:
        assert whole["prompt_tokens"] == prompt
        assert whole["prompt_cache_hit_tokens"] == hits
        assert whole["prompt_cache_miss_tokens"] == prompt - hits
        assert whole["prompt_tokens_details"]["cached_tokens"] == hits
    elif protocol is RESPONSES:
        assert whole["input_tokens"] == prompt
        assert whole["input_tokens_details"]["cached_tokens"] == hits
    else:  # Anthropic: input_tokens are the prompt tokens not read from the cache
        assert whole["cache_read_input_tokens"] == hits
        assert whole["input_tokens"] == prompt - hits
        assert whole["cache_creation_input_tokens"] == 0
