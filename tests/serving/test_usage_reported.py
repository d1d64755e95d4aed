"""Usage on a live server: the engine's token counts, the same streamed or not, reasoning
in tokens, Chat's streamed usage only when asked for, in OpenAI's shape, and prompt-cache
hits as the engine counted them, less the tokens bounded replay recomputed (usage.py)."""

import json
import re
import time
import uuid

import pytest
import requests

from helpers import NO_THINKING, SERVED_NAME, metric

pytestmark = pytest.mark.server
HELLO = [{"role": "user", "content": "Hello"}]
EOS = 1  # the tiny tokenizer's end of sentence


def sse_data(api_server, path, body) -> list[dict]:
    response = requests.post(
        f"{api_server}{path}", json={**body, "stream": True}, stream=True, timeout=120
    )
    lines = [line.decode() for line in response.iter_lines() if line.startswith(b"data: ")]
    return [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]


def test_chat_usage_is_exact_and_reasoning_counts_tokens(oa):
    """EOS biased away: the answer runs to max_tokens, all of it thinking (the random model
    does not close it), so reasoning_tokens == completion_tokens == max_tokens."""
    reply = oa.chat.completions.create(
        model=SERVED_NAME, max_tokens=12, seed=3, logit_bias={str(EOS): -100}, messages=HELLO
    )
    assert reply.choices[0].finish_reason == "length" and not reply.choices[0].message.content
    usage = reply.usage
    assert usage.completion_tokens == 12 == usage.completion_tokens_details.reasoning_tokens
    assert usage.total_tokens == usage.prompt_tokens + 12


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_usage_streamed_and_not_agree(oa, api_server, thinking):
    body = {
        "model": SERVED_NAME,
        "messages": HELLO,
        "max_tokens": 16,
        "seed": 11,
        "temperature": 0.0,
        **({} if thinking else NO_THINKING),
    }
    whole = requests.post(f"{api_server}/v1/chat/completions", json=body, timeout=120).json()
    silent = sse_data(api_server, "/v1/chat/completions", body)
    assert all("usage" not in chunk for chunk in silent)  # not asked for: none
    asked = sse_data(
        api_server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert all(chunk["usage"] is None and len(chunk["choices"]) == 1 for chunk in asked[:-1])
    assert asked[-1]["choices"] == [] and asked[-1]["usage"] == whole["usage"]
    if thinking:
        details = whole["usage"]["completion_tokens_details"]
        assert details["reasoning_tokens"] <= whole["usage"]["completion_tokens"]


def test_responses_usage_streamed_and_not_agree(api_server):
    body = {"model": SERVED_NAME, "input": "Hello", "max_output_tokens": 16, "seed": 5}
    whole = requests.post(f"{api_server}/v1/responses", json=body, timeout=120).json()
    events = sse_data(api_server, "/v1/responses", body)
    final = [e for e in events if e["type"] in ("response.completed", "response.incomplete")]
    assert final[-1]["response"]["usage"] == whole["usage"]
    usage = whole["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    reasoning = usage["output_tokens_details"]["reasoning_tokens"]
    if whole["status"] == "incomplete" and len(whole["output"]) == 1:  # only thinking
        assert reasoning == usage["output_tokens"] == 16
    assert reasoning <= usage["output_tokens"]


def test_messages_usage_streamed_and_not_agree(claude):
    request = dict(
        model=SERVED_NAME,
        max_tokens=16,
        thinking={"type": "disabled"},
        messages=HELLO,
        extra_body={"temperature": 0.0},
    )
    whole = claude.messages.create(**request)
    with claude.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert (
        whole.usage.output_tokens == 16
        if whole.stop_reason == "max_tokens"
        else 0 < whole.usage.output_tokens <= 16
    )


KEEP = 140  # DEEPINFER_YOCO_PREFILL_KEEP_TOKENS's default, which the shared server runs with
BLOCK = 16
SYSTEM = "The quick brown fox jumps over the lazy dog. " * 40
ROUTES = {  # a body with the system prompt, and where its streamed usage is
    "/v1/chat/completions": lambda system: {
        "model": SERVED_NAME,
        "max_tokens": 2,
        "temperature": 0.0,
        **NO_THINKING,
        "messages": [{"role": "system", "content": system}, *HELLO],
    },
    "/v1/responses": lambda system: {
        "model": SERVED_NAME,
        "max_output_tokens": 2,
        "temperature": 0.0,
        "reasoning": {"effort": "none"},  # no reasoning-effort preamble before the nonce
        "instructions": system,
        "input": "Hello",
    },
    "/v1/messages": lambda system: {
        "model": SERVED_NAME,
        "max_tokens": 2,
        "temperature": 0.0,
        **NO_THINKING,
        "system": system,
        "messages": HELLO,
    },
}
COUNTERS = (
    "deepinfer:prefix_saved_tokens_total",
    "deepinfer:prefix_replayed_tokens_total",
    "vllm:prefix_cache_hits_total",
)


def prompt_and_hits(path: str, usage: dict) -> tuple[int, int]:
    """The prompt's tokens and its cache hits, read from each protocol's usage; checks
    the protocol's own accounting of them."""
    if path == "/v1/chat/completions":
        hits = usage["prompt_cache_hit_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == hits
        assert hits + usage["prompt_cache_miss_tokens"] == usage["prompt_tokens"]
        return usage["prompt_tokens"], hits
    if path == "/v1/responses":
        return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
    hits = usage["cache_read_input_tokens"]  # Anthropic: input_tokens leaves the hits out
    assert usage["cache_creation_input_tokens"] == 0
    return usage["input_tokens"] + hits, hits


def streamed_usage(api_server, path: str, body: dict) -> dict:
    if path == "/v1/chat/completions":
        body = {**body, "stream_options": {"include_usage": True}}
    usages = [
        (e.get("response") or e.get("message") or e).get("usage")
        for e in sse_data(api_server, path, body)
    ]
    return [usage for usage in usages if usage][-1]


def hit_alignment(server) -> int:
    """What a prefix hit is a whole number of: the least common multiple of the cache
    groups' block sizes, as the engine logged it (vLLM sizes the groups' blocks itself,
    and not alike on every machine: 128 tokens where 16 was assumed before), else BLOCK."""
    log = server.stdout.read_text() + server.stderr.read_text()
    found = re.search(r"kv lcm block sizes (\d+)", log)
    return int(found.group(1)) if found else BLOCK


def test_prompt_cache_hits_on_every_route_match_the_engines_counters(api_server):
    """Each route's prompt, first cold (its system prompt starts with a nonce: no block of
    it is cached), then twice a prefix hit, whole and streamed: the hit is the prompt's
    whole aligned blocks less the KEEP tokens replayed, the same streamed or not, and
    /metrics agrees: the engine's own hit counter grew by the hits plus KEEP per hit
    request, and the plugin's saved-tokens counter by the hits."""
    alignment = hit_alignment(api_server)
    before = [metric(api_server, name) for name in COUNTERS]
    reported, hit_requests = 0, 0
    for path, make_body in ROUTES.items():
        body = make_body(f"{uuid.uuid4().hex} {SYSTEM}")
        cold = requests.post(f"{api_server}{path}", json=body, timeout=120).json()["usage"]
        warm = requests.post(f"{api_server}{path}", json=body, timeout=120).json()["usage"]
        streamed = streamed_usage(api_server, path, body)
        assert streamed == warm, path
        prompt, cold_hits = prompt_and_hits(path, cold)
        assert cold_hits == 0 and prompt_and_hits(path, warm)[0] == prompt > KEEP + alignment
        hits = prompt_and_hits(path, warm)[1]
        cached = hits + KEEP  # the engine's figure: the prompt's whole blocks but the last token
        assert hits > 0 and cached % alignment == 0, path
        assert prompt - alignment <= cached < prompt, path
        reported += 2 * hits
        hit_requests += 2
    expected = [
        before[0] + reported,
        before[1] + KEEP * hit_requests,
        before[2] + reported + KEEP * hit_requests,
    ]
    for _ in range(50):  # the engine's stats for a finished request arrive after it
        if [metric(api_server, name) for name in COUNTERS] == expected:
            break
        time.sleep(0.1)
    assert [metric(api_server, name) for name in COUNTERS] == expected
