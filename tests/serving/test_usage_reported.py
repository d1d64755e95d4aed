"""Usage on a live server: the engine's token counts, the same streamed or not, reasoning
in tokens, and Chat's streamed usage only when asked for, in OpenAI's shape."""
import json

import pytest
import requests
from helpers import NO_THINKING, SERVED_NAME

pytestmark = pytest.mark.server
HELLO = [{"role": "user", "content": "Hello"}]
EOS = 1  # the tiny tokenizer's end of sentence


def sse_data(api_server, path, body) -> list[dict]:
    response = requests.post(f"{api_server}{path}", json={**body, "stream": True}, stream=True,
                             timeout=120)
    lines = [line.decode() for line in response.iter_lines() if line.startswith(b"data: ")]
    return [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]


def test_chat_usage_is_exact_and_reasoning_counts_tokens(oa):
    """EOS biased away: the answer runs to max_tokens, all of it thinking (the random model
    does not close it), so reasoning_tokens == completion_tokens == max_tokens."""
    reply = oa.chat.completions.create(model=SERVED_NAME, max_tokens=12, seed=3,
                                       logit_bias={str(EOS): -100}, messages=HELLO)
    assert reply.choices[0].finish_reason == "length" and not reply.choices[0].message.content
    usage = reply.usage
    assert usage.completion_tokens == 12 == usage.completion_tokens_details.reasoning_tokens
    assert usage.total_tokens == usage.prompt_tokens + 12


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_usage_streamed_and_not_agree(oa, api_server, thinking):
    body = {"model": SERVED_NAME, "messages": HELLO, "max_tokens": 16, "seed": 11,
            "temperature": 0.0, **({} if thinking else NO_THINKING)}
    whole = requests.post(f"{api_server}/v1/chat/completions", json=body, timeout=120).json()
    silent = sse_data(api_server, "/v1/chat/completions", body)
    assert all("usage" not in chunk for chunk in silent)  # not asked for: none
    asked = sse_data(api_server, "/v1/chat/completions",
                     {**body, "stream_options": {"include_usage": True}})
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
    request = dict(model=SERVED_NAME, max_tokens=16, thinking={"type": "disabled"},
                   messages=HELLO, extra_body={"temperature": 0.0})
    whole = claude.messages.create(**request)
    with claude.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert whole.usage.output_tokens == 16 if whole.stop_reason == "max_tokens" \
        else 0 < whole.usage.output_tokens <= 16
