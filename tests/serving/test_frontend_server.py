"""The DeepSeek API front end on a live `deepinfer serve` (VLLM_PLUGINS=deepinfer), driven
by the real `openai` and `anthropic` clients, and by raw HTTP for malformed input."""

import json
import re
import time

import anthropic
import openai
import pytest
import requests

from helpers import NO_THINKING, SERVED_NAME, metric

pytestmark = pytest.mark.server

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
EOS = 1  # the tiny tokenizer's end of sentence: biased away, a reply runs to max_tokens
NO_EOS = {str(EOS): -100}


def test_chat_reasoning_and_usage(oa):
    """Thinking is V4.1's default: everything before </think> is reasoning content."""
    reply = oa.chat.completions.create(
        model=SERVED_NAME,
        max_tokens=12,
        logit_bias=NO_EOS,
        messages=[{"role": "user", "content": "Hello"}],
    )
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"]
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_chat_logprobs_are_the_engines(oa, api_server, vision_checkpoint):
    """The same greedy request's logprobs through vLLM's own /v1/completions, on the prompt
    ids the front end encodes (checked equal by their count)."""
    import deepseek_recipe as dr

    from vllm_deepinfer.serving.prompts import PromptEncoder

    messages = [{"role": "user", "content": "Hello"}]
    reply = oa.chat.completions.create(
        model=SERVED_NAME,
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
        temperature=0.0,
        logit_bias=NO_EOS,
        extra_body=NO_THINKING,
        messages=messages,
    )
    converted = dr.ChatCompletionRequest(
        json.dumps({"model": "DeepSeek-V4.1-Flash", "messages": messages, **NO_THINKING}).encode()
    ).convert(dr.ConversionOptions())
    prompt = PromptEncoder(vision_checkpoint).encode(converted.conversation)
    assert len(prompt) == reply.usage.prompt_tokens
    expected = requests.post(
        f"{api_server}/v1/completions",
        timeout=60,
        json={
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": 6,
            "temperature": 0.0,
            "logprobs": 2,
            "logit_bias": NO_EOS,
        },
    ).json()["choices"][0]["logprobs"]
    content = reply.choices[0].logprobs.content
    assert [entry.logprob for entry in content] == pytest.approx(
        expected["token_logprobs"], abs=1e-5
    )
    for entry, top in zip(content, expected["top_logprobs"]):
        # vLLM keys alternatives by their text: two that decode alike are one entry there.
        alternatives = [alt.logprob for alt in entry.top_logprobs]
        assert len(alternatives) == 2 and alternatives[0] == entry.logprob  # greedy: rank 1
        assert all(min(abs(lp - alt) for alt in alternatives) < 1e-5 for lp in top.values())


def test_chat_streaming_matches_its_usage(oa):
    request = dict(
        model=SERVED_NAME,
        max_tokens=10,
        temperature=0.0,
        logit_bias=NO_EOS,
        extra_body=NO_THINKING,
        messages=[{"role": "user", "content": "Hello"}],
    )
    whole = oa.chat.completions.create(**request)
    chunks = list(
        oa.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage == whole.usage and whole.usage.completion_tokens == 10


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence_across_token_boundaries(oa, stream):
    """A stop string spanning two tokens ends the answer right before it."""
    request = dict(
        model=SERVED_NAME,
        max_tokens=12,
        temperature=0.0,
        extra_body=NO_THINKING,
        messages=[{"role": "user", "content": "Count with me"}],
    )
    text = oa.chat.completions.create(**request).choices[0].message.content
    stop = text[8:14]
    assert len(stop) == 6 and text.count(stop) == 1
    if stream:
        chunks = list(oa.chat.completions.create(**request, stop=[stop], stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = oa.chat.completions.create(**request, stop=[stop]).choices[0]
        content, finish = choice.message.content, choice.finish_reason
    assert finish == "stop" and content == text[: text.index(stop)]


def test_prompt_cache_hits_are_reported(oa, api_server):
    """usage carries the prefix-cache hit as the engine counted it less the 140 tokens
    bounded replay recomputed (usage.py); /metrics says what was replayed and saved."""
    names = ("deepinfer:prefix_replayed_tokens_total", "deepinfer:prefix_saved_tokens_total")
    before = [metric(api_server, name) for name in names]
    long_message = "The quick brown fox jumps over the lazy dog. " * 40
    usages = [
        oa.chat.completions.create(
            model=SERVED_NAME,
            max_tokens=2,
            extra_body=NO_THINKING,
            messages=[{"role": "user", "content": long_message}],
        ).usage
        for _ in range(2)
    ]
    assert usages[0].prompt_tokens == usages[1].prompt_tokens > 200
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert cached >= 192 - 140
    expected = [before[0] + 140, before[1] + cached]
    for _ in range(50):  # counted when the engine's stats for the finished request arrive
        if [metric(api_server, name) for name in names] == expected:
            break
        time.sleep(0.1)
    assert [metric(api_server, name) for name in names] == expected


def test_json_schema_output_parses_and_ends_with_eos(oa):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    reply = oa.chat.completions.create(
        model=SERVED_NAME,
        max_tokens=200,
        temperature=0.0,
        extra_body=NO_THINKING,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        messages=[{"role": "user", "content": "What is 2+2?"}],
    )
    assert reply.choices[0].finish_reason == "stop"
    assert 0 <= json.loads(reply.choices[0].message.content)["answer"] <= 9


def test_response_format_schemas_go_through_the_checked_pipeline(oa):
    """Non-strict response_format goes through the same pipeline as so_args: a long
    length limit (repeat bounds above xgrammar's 128) compiles and holds; a keyword the
    grammar cannot enforce is a 400 naming it and the node, not a failure in the engine."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 300}},
        "required": ["name"],
        "additionalProperties": False,
    }
    reply = oa.chat.completions.create(
        model=SERVED_NAME,
        max_tokens=60,
        temperature=0.0,
        extra_body=NO_THINKING,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        messages=[{"role": "user", "content": "Name?"}],
    )
    content = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        name = json.loads(content)["name"]
        assert len(name) <= 300 and not any(ord(c) < 0x20 for c in name)
    else:  # cut by max_tokens inside the string: still no raw control character
        assert content.startswith('{"name":"') and not any(ord(c) < 0x20 for c in content)
    refused = {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 3}}}
    with pytest.raises(openai.BadRequestError) as error:
        oa.chat.completions.create(
            model=SERVED_NAME,
            max_tokens=5,
            extra_body=NO_THINKING,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "r", "schema": refused},
            },
            messages=[{"role": "user", "content": "x?"}],
        )
    assert "unsupported JSON Schema keyword 'multipleOf' at $.properties.x" in str(error.value)


def test_json_schema_applies_after_the_thinking_part(oa, api_server):
    """Thinking on: the grammar starts after </think> (here the first token, by a bias
    that the grammar then overrules), so the answer is schema JSON and nothing before it."""
    end_of_thinking = requests.post(
        f"{api_server}/tokenize",
        timeout=30,
        json={"model": SERVED_NAME, "prompt": "</think>", "add_special_tokens": False},
    ).json()["tokens"]
    assert len(end_of_thinking) == 1
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    reply = oa.chat.completions.create(
        model=SERVED_NAME,
        max_tokens=40,
        seed=1,
        logit_bias={str(end_of_thinking[0]): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}},
        messages=[{"role": "user", "content": "OK?"}],
    )
    message = reply.choices[0].message
    assert not message.model_extra.get("reasoning_content")
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(message.content)["ok"], bool)


def test_json_object_output_is_constrained(oa):
    """json_object reaches the engine as a JSON grammar. The random tiny model never
    closes the string it opens, so this checks the constraint, not a finished object."""
    reply = oa.chat.completions.create(
        model=SERVED_NAME,
        max_tokens=20,
        temperature=0.0,
        extra_body=NO_THINKING,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Answer in json: what is 2+2?"}],
    )
    unconstrained = oa.chat.completions.create(
        model=SERVED_NAME,
        max_tokens=20,
        temperature=0.0,
        extra_body=NO_THINKING,
        messages=[{"role": "user", "content": "Answer in json: what is 2+2?"}],
    )
    content = reply.choices[0].message.content
    assert content.lstrip().startswith("{")
    assert content != unconstrained.choices[0].message.content


def test_so_args_extra_field(oa):
    """DeepInfer's so_args in the HTTP API: a regex the output must match in full."""
    reply = oa.chat.completions.create(
        model=SERVED_NAME,
        max_tokens=30,
        temperature=0.0,
        extra_body={
            **NO_THINKING,
            "so_args": {"schema_type": "regex", "schema": "(yes|no)-[0-9]{3}"},
        },
        messages=[{"role": "user", "content": "Answer"}],
    )
    assert reply.choices[0].finish_reason == "stop"
    assert re.fullmatch("(yes|no)-[0-9]{3}", reply.choices[0].message.content)
    with pytest.raises(openai.BadRequestError) as error:
        oa.chat.completions.create(
            model=SERVED_NAME,
            max_tokens=5,
            extra_body={"so_args": {"schema_type": "regex", "schema": "a(b"}},
            messages=[{"role": "user", "content": "Answer"}],
        )
    assert "invalid regex" in str(error.value)


def test_grammar_compile_metrics(oa, api_server):
    """Compile time and cache hits of grammars compiled outside the engine, on /metrics."""
    so_args = {"schema_type": "regex", "schema": "(up|down)-[0-9]{2}"}
    before = (
        metric(api_server, "deepinfer:grammar_cache_hits_total"),
        metric(api_server, "deepinfer:grammar_compiles_total"),
    )
    for _ in range(2):
        oa.chat.completions.create(
            model=SERVED_NAME,
            max_tokens=10,
            extra_body={**NO_THINKING, "so_args": so_args},
            messages=[{"role": "user", "content": "Go"}],
        )
    after = (
        metric(api_server, "deepinfer:grammar_cache_hits_total"),
        metric(api_server, "deepinfer:grammar_compiles_total"),
    )
    assert after[1] == before[1] + 1 and after[0] == before[0] + 1
    assert metric(api_server, "deepinfer:grammar_compile_seconds_count") >= 2


def test_tool_call_round_trip(oa):
    """Tools are offered, and a tool call with its result comes back in the history."""
    first = oa.chat.completions.create(
        model=SERVED_NAME,
        max_tokens=8,
        tools=[WEATHER_TOOL],
        extra_body=NO_THINKING,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    second = oa.chat.completions.create(
        model=SERVED_NAME,
        max_tokens=8,
        tools=[WEATHER_TOOL],
        extra_body=NO_THINKING,
        messages=history,
    )
    assert second.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_responses_api(oa):
    reply = oa.responses.create(model=SERVED_NAME, input="Hello", max_output_tokens=8)
    assert reply.status in ("incomplete", "completed") and reply.output[0].type == "reasoning"
    events = list(
        oa.responses.create(
            model=SERVED_NAME,
            input="Hello",
            max_output_tokens=8,
            temperature=0.0,
            reasoning={"effort": "none"},
            stream=True,
        )
    )
    assert events[0].type == "response.created"
    assert any(e.type == "response.output_text.delta" for e in events)


def test_messages_api(claude):
    reply = claude.messages.create(
        model=SERVED_NAME, max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
    )
    assert reply.content[0].type == "thinking"
    assert reply.stop_reason in ("max_tokens", "end_turn")
    with claude.messages.stream(
        model=SERVED_NAME,
        max_tokens=8,
        thinking={"type": "disabled"},
        messages=[{"role": "user", "content": "Hello"}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text
    assert (
        final.usage.output_tokens == 8
        if final.stop_reason == "max_tokens"
        else 0 < final.usage.output_tokens < 8
    )


def test_messages_errors_are_anthropic_shaped(claude):
    with pytest.raises(anthropic.NotFoundError) as error:
        claude.messages.create(
            model="claude-opus", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
        )
    assert error.value.body["type"] == "error"
    assert "claude-opus" in error.value.body["error"]["message"]


JSON = {"Content-Type": "application/json"}
PATHS = {
    "/v1/chat/completions": ("messages", False),
    "/v1/responses": ("input", False),
    "/v1/messages": ("messages", True),
}


def body_for(path, **fields):
    key, anthropic_shape = PATHS[path]
    body = {"model": SERVED_NAME, key: [{"role": "user", "content": "hi"}]}
    if anthropic_shape:
        body["max_tokens"] = 8
    body.update(fields)
    return body


IMAGE = [
    {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}],
    }
]
BAD_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "case,send,message",
    [
        ("malformed json", lambda p: dict(data=b'{"model": ', headers=JSON), "invalid JSON"),
        (
            "wrong content type",
            lambda p: dict(data=json.dumps(body_for(p)), headers={"Content-Type": "text/plain"}),
            "Content-Type must be application/json",
        ),
        (
            "missing field",
            lambda p: dict(json={"model": SERVED_NAME}),
            ("missing field", "Either input or instructions must be provided"),
        ),
        ("mistyped field", lambda p: dict(json=body_for(p, model=7)), "invalid type"),
        ("unsupported model", lambda p: dict(json=body_for(p, model="gpt-x")), "gpt-x"),
        (
            "max_tokens beyond context",
            lambda p: dict(
                json=body_for(
                    p, **{"max_output_tokens" if p == "/v1/responses" else "max_tokens": 100_000}
                )
            ),
            "context length",
        ),
        ("empty message list", lambda p: dict(json=body_for(p, **{PATHS[p][0]: []})), ""),
    ],
)
def test_malformed_input_gets_the_protocols_error(api_server, path, case, send, message):
    response = requests.post(api_server + path, timeout=60, **send(path))
    assert 400 <= response.status_code < 500, (case, response.status_code, response.text)
    body = response.json()
    error = body["error"]
    if PATHS[path][1]:
        assert body["type"] == "error" and error["type"].endswith("_error")
    else:
        assert error["type"] == "invalid_request_error"
    accepted = message if isinstance(message, tuple) else (message,)
    assert error["message"] and any(m in error["message"] for m in accepted)


@pytest.mark.parametrize(
    "case,fields,message",
    [
        ("invalid tool schema", {"tools": BAD_TOOL}, "Invalid schema for function 'f'"),
        ("broken image data URL", {"messages": IMAGE}, "base64"),
    ],
)
def test_chat_specific_bad_input(api_server, case, fields, message):
    response = requests.post(
        f"{api_server}/v1/chat/completions",
        timeout=60,
        json=body_for("/v1/chat/completions", **fields),
    )
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


PNG_1X1 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9a"
    "wAAAABJRU5ErkJggg=="
)
IMAGE_CONTENT = {
    "/v1/chat/completions": {
        "type": "image_url",
        "image_url": {"url": f"data:image/png;base64,{PNG_1X1}"},
    },
    "/v1/responses": {"type": "input_image", "image_url": f"data:image/png;base64,{PNG_1X1}"},
    "/v1/messages": {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": PNG_1X1},
    },
}


@pytest.mark.parametrize("path", PATHS)
def test_image_requests_are_served_on_every_route(api_server, path):
    """The served checkpoint is the vision-language release form: each route's image
    shape, as raw JSON, reaches the model (a 1x1 PNG, enlarged to the minimum pixels)."""
    text = {"type": "input_text" if path == "/v1/responses" else "text", "text": "What is it?"}
    content = [IMAGE_CONTENT[path], text]
    limit = {
        "/v1/chat/completions": "max_tokens",
        "/v1/responses": "max_output_tokens",
        "/v1/messages": "max_tokens",
    }[path]
    response = requests.post(
        api_server + path,
        timeout=60,
        json=body_for(path, **{PATHS[path][0]: [{"role": "user", "content": content}], limit: 4}),
    )
    assert response.status_code == 200, response.text


def test_server_keeps_serving_after_bad_input(oa, api_server):
    refused = requests.post(
        f"{api_server}/v1/chat/completions", data=b"{", headers=JSON, timeout=60
    )
    assert refused.status_code == 400
    reply = oa.chat.completions.create(
        model=SERVED_NAME,
        max_tokens=3,
        temperature=0.0,
        extra_body=NO_THINKING,
        messages=[{"role": "user", "content": "still there?"}],
    )
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_a_client_gone_before_its_answer_stops_the_engine_request(api_server):
    """A non-streamed request whose client disconnects is aborted in the engine at once,
    from the moment its body is read: one gone a third into its prefill (a fresh
    ~1800-token prompt) never generates a token, and one gone while decoding stops
    within a second, far short of max_tokens. (The front end awaits the disconnect
    message; it used to poll for it only once the first token was out, so a prefill ran
    to its end.)"""
    import socket
    import uuid
    from urllib.parse import urlparse

    url = urlparse(api_server)

    def generated() -> float:
        return metric(api_server, "vllm:generation_tokens_total")

    def fresh_prompt() -> str:  # no prefix-cache hit
        return uuid.uuid4().hex + " " + " ".join(f"w{i}" for i in range(370))

    def body(text: str, max_tokens: int) -> dict:
        return {
            "model": SERVED_NAME,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "logit_bias": NO_EOS,
            **NO_THINKING,
        }

    def leave(text: str, after_seconds: float = 0.0, after_tokens: int = 0) -> float:
        """The tokens generated for a request whose client leaves after that long and
        that many tokens, counted once the engine is quiet."""
        request = json.dumps(body(text, 200)).encode()
        start = generated()
        with socket.create_connection((url.hostname, url.port)) as client:
            client.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
                b"Content-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(request), request)
            )
            time.sleep(after_seconds)
            deadline = time.monotonic() + 60
            while generated() - start < after_tokens:
                assert time.monotonic() < deadline, "the request never got that far"
                time.sleep(0.02)
        quiet = generated()
        while True:  # a second with nothing generated
            time.sleep(1.0)
            if generated() == quiet:
                return quiet - start
            quiet = generated()

    began = time.monotonic()
    requests.post(
        f"{api_server}/v1/chat/completions", json=body(fresh_prompt(), 1), timeout=120
    ).raise_for_status()
    prefill = time.monotonic() - began
    assert leave(fresh_prompt(), after_seconds=prefill / 3) == 0
    assert leave("Hi", after_tokens=10) < 40
