"""No request kills or starves the server: random bodies on every route it offers, clients
that go away at random moments, and a burst of image requests at and over the image
bounds, all on the shared `api_server` (no server of their own).

- Every route answers each random body, valid or not, within a timeout: a 200 with a
  well-formed body (a stream that ends as its protocol ends it), or a 4xx with a JSON
  error body saying what is wrong (on the DeepSeek API routes in the protocol's own
  shape); never a 5xx, a hang or a dropped connection. Afterwards /health is 200, a
  normal request is answered and no request is left running or waiting.
- Clients that leave while sending their body, while waiting for the answer or in the
  middle of a stream leave no request running or waiting in the engine.
- Concurrent image requests at the per-request bounds, beside requests over them (each
  refused naming its bound), keep the API server's peak RSS within a budget, and its
  RSS goes back near where it was.

Each case is generated from (seed, route, case number) alone: a failure prints the
seed, the case and its body. DEEPINFER_FUZZ_SEED picks the seed (default 0, so CI runs
the same cases every time); DEEPINFER_FUZZ_CASES the number of cases per route, and
twice the number of disconnects per route (default 8; `DEEPINFER_FUZZ_CASES=500` for a
long run).
"""

import contextlib
import json
import os
import random
import socket
import struct
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlparse

import pytest
import requests

from helpers import (
    NO_THINKING,
    SERVED_NAME,
    data_url,
    image_bytes,
    metric,
    png_header,
    solid_png,
)

pytestmark = pytest.mark.server

SEED = int(os.environ.get("DEEPINFER_FUZZ_SEED", "0"))
CASES = int(os.environ.get("DEEPINFER_FUZZ_CASES", "8"))
REPLY_TIMEOUT_S = 60
"""An answer (for a stream: each next line of it) within this, or the case hangs. The
slowest valid cases (prompts near the context length, 128 choices) take seconds on the
2-core build machine."""
IDLE_WITHIN_S = 10
"""After the cases, the engine's running and waiting gauges are back to 0 within this."""
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
NOT_FUZZED = {
    "/scale_elastic_ep": "an operator's control route: a valid body rescales the server",
}
# --- what bodies are made of ----------------------------------------------------------


def _b64(data: bytes) -> str:
    return data_url(data).partition(",")[2]


TINY_PNG = solid_png(8, 8)
IMAGES = {  # name: (media type, base64 data)
    "png": ("image/png", _b64(TINY_PNG)),
    "jpeg": ("image/jpeg", _b64(image_bytes(24, 16, 0, "JPEG"))),
    "sliver": ("image/png", _b64(solid_png(1, 900))),
    "corrupt base64": ("image/png", "!!not*base64"),
    "truncated": ("image/png", _b64(image_bytes(40, 30, 1)[:-200])),
    "not an image": ("image/png", _b64(b"hello")),
    "wrong media type": ("text/plain", _b64(TINY_PNG)),
    "bmp": ("image/bmp", _b64(image_bytes(8, 8, 2, "BMP"))),
    "huge header": ("image/png", _b64(png_header(100_000, 100_000))),
    "over the pixel bound": ("image/png", _b64(solid_png(1100, 1000))),
}
ODD_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    0.5,
    -1e-9,
    2**31,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    1e308,
    "",
    "1",
    "x" * 10_000,
    "\ud800",
    [],
    [1, "a"],
    {},
    {"a": {"b": []}},
]
TEXTS = [
    "Hello",
    "",
    " ",
    "Tell me a story about a fox.",
    "<｜User｜></think>｜DSML｜ calls",
    "\ud800 lone surrogate",
    "emoji 🦊 and 字",
    "\x00\x01 control",
]


def text(rng: random.Random) -> str:
    return rng.choice(TEXTS)


def long_text(rng: random.Random) -> str:
    """Up to ~700 times the context length."""
    return "word " * rng.choice([3_000, 30_000, 300_000])


def nested_schema(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


def schema(rng: random.Random):
    """A JSON Schema: valid, invalid, deeply nested, recursive, costly or not one at all."""
    return rng.choice(
        [
            lambda: {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
                "required": ["a"],
            },
            lambda: {"type": "nope"},
            lambda: rng.choice([[], "object", 5, None, True]),
            lambda: nested_schema(rng.choice([8, 40, 200])),
            lambda: {"type": "object", "properties": {"child": {"$ref": "#"}}},
            lambda: {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
            lambda: {"$ref": "#/$defs/missing"},
            lambda: {"type": "string", "pattern": "(a+)+$"},
            lambda: {"type": "string", "pattern": "(["},
            lambda: {"enum": list(range(3000))},
            lambda: {"type": "array", "items": {"type": "integer"}, "minItems": 10**9},
            lambda: {"type": "string", "maxLength": 10**12},
        ]
    )()


def so_args(rng: random.Random):
    return rng.choice(
        [
            {"schema_type": "regex", "schema": "(yes|no)"},
            {"schema_type": "regex", "schema": "a(b"},
            {"schema_type": "json", "schema": schema(rng)},
            {"schema_type": "ebnf", "schema": 'root ::= "a" | "b"'},
            {"schema_type": "ebnf", "schema": "root ::= ("},
            {"schema_type": "bogus", "schema": "x"},
            {"schema_type": "regex"},
            "regex",
        ]
    )


def tool_names(rng: random.Random):
    return rng.choice(["get_weather", "get_weather", "", "a" * 300, "bad name!", 5, None])


# --- the routes ------------------------------------------------------------------------


def error_message(body) -> str | None:
    """The message of an error body (None: not one). vLLM's own routes answer OpenAI-shaped
    errors (`{"error": {"message": ...}}`), Anthropic-shaped ones on count_tokens, and
    FastAPI's `{"detail": ...}` for a body it cannot parse."""
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if message is None and isinstance(body, dict) and set(body) == {"detail"}:
        message = body["detail"]
    return message if isinstance(message, str) and message.strip() else None


def openai_error(body) -> str | None:
    """The DeepSeek API front end's OpenAI-shaped error (vLLM's own says BadRequestError
    where OpenAI says invalid_request_error: one of those is a leak past the front end)."""
    message = error_message(body)
    return message if message and body["error"].get("type") == "invalid_request_error" else None


def anthropic_error(body) -> str | None:
    message = error_message(body)
    return message if message and body.get("type") == "error" else None


def sse_events(lines: list[str]) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event."""
    events, name = [], None
    for line in lines:
        if line.startswith("event:"):
            name = line[len("event:") :].strip()
        elif line.startswith("data:"):
            events.append((name, line[len("data:") :].strip()))
            name = None
    return events


def stream_problem(lines: list[str], ends: Callable[[list], bool]) -> str | None:
    """What is wrong with a 200 stream: an error event, data that is not JSON, or no end."""
    events = sse_events(lines)
    for name, data in events:
        if data == "[DONE]":
            continue
        try:
            payload = json.loads(data)
        except ValueError:
            return f"stream data is not JSON: {data[:200]!r}"
        if name == "error" or (isinstance(payload, dict) and "error" in payload):
            return f"the stream ended in an error: {data[:500]}"
    return None if events and ends(events) else f"the stream did not end: {lines[-3:]}"


def done_marker(events) -> bool:
    return events[-1][1] == "[DONE]"


def has_event(*names: str) -> Callable[[list], bool]:
    """A stream that ends with one of these events (named, or typed in its data)."""

    def kind(name, data):
        payload = json.loads(data) if name is None and data != "[DONE]" else None
        return payload.get("type") if isinstance(payload, dict) else name

    return lambda events: any(kind(name, data) in names for name, data in events)


@dataclass(frozen=True)
class Route:
    """How to make random bodies for a route and what its answers must look like."""

    path: str
    base: Callable[[random.Random], dict]  # a valid body
    params: dict = field(default_factory=dict)  # field: values to try besides ODD_VALUES
    limit: str | None = None  # the field bounding generation: never sent unbounded
    messages: Callable[[random.Random], object] | None = None  # a random conversation
    content: Callable[[random.Random], object] | None = None  # random content of a turn
    extras: tuple[Callable[[random.Random], dict], ...] = ()  # random groups of fields
    well_formed: Callable[[object], bool] | None = None  # a 200's JSON (None: any body)
    stream_ends: Callable[[list], bool] = done_marker
    message_of: Callable[[object], str | None] = error_message  # of its error bodies


LIMITS = [1, 2, 4, 8]
SAMPLING = {
    "temperature": [0.0, 0.7, 1.0, 2.0, 2.5, -1.0],
    "top_p": [1e-9, 0.5, 1.0, 0.0, 1.5],
    "seed": [0, 7, -1, 2**63 - 1, 2**63, 2**64],
    "stream": [True, False],
    "frobnicate": [1, "x"],  # a field no protocol has
}
DEEPSEEK = {
    **SAMPLING,
    "seq_seed": [3, -(2**63), 2**64, "3"],
    "so_args": [],  # odd values only: so_args() makes the others, as an extra
    "thinking": [{"type": "disabled"}, {"type": "enabled"}, {"type": "bogus"}, {}],
}


def chat_image(media: str, data: str) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def responses_image(media: str, data: str) -> dict:
    return {"type": "input_image", "image_url": f"data:{media};base64,{data}"}


def messages_image(media: str, data: str) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}


def chat_part(rng: random.Random):
    kind = rng.choice(["text", "image", "image", "url", "file", "odd"])
    if kind == "text":
        return {"type": "text", "text": text(rng)}
    if kind == "image":
        return chat_image(*IMAGES[rng.choice(list(IMAGES))])
    if kind == "url":
        return {
            "type": "image_url",
            "image_url": {
                "url": rng.choice(
                    ["http://127.0.0.1:9/cat.png", "data:image/png,%89PNG", "data:", "", 5]
                )
            },
        }
    if kind == "file":
        return {
            "type": "file",
            "file": rng.choice(
                [
                    {"filename": "a.txt", "file_data": data_url(b"notes", "text/plain")},
                    {"filename": "a.pdf", "file_data": data_url(b"%PDF-1.4", "application/pdf")},
                    {"file_id": "file-123"},
                    {"file_data": "not a data url"},
                    {},
                ]
            ),
        }
    return rng.choice(
        [
            {"type": "audio", "input_audio": {}},
            {"type": None},
            {"type": ["text"]},
            {"text": "no type"},
            "a string",
            5,
            None,
        ]
    )


def responses_part(rng: random.Random):
    kind = rng.choice(["text", "image", "image", "file", "odd"])
    if kind == "text":
        return {"type": "input_text", "text": text(rng)}
    if kind == "image":
        return rng.choice(
            [
                responses_image(*IMAGES[rng.choice(list(IMAGES))]),
                {"type": "input_image", "image_url": "http://127.0.0.1:9/cat.png"},
                {"type": "input_image"},
            ]
        )
    if kind == "file":
        return {
            "type": "input_file",
            **rng.choice(
                [
                    {"filename": "a.md", "file_data": data_url(b"# notes", "text/markdown")},
                    {"filename": "a.pdf", "file_data": data_url(b"%PDF-1.4", "application/pdf")},
                    {"file_id": "file-1"},
                    {"file_url": "http://127.0.0.1:9/a.txt"},
                    {},
                ]
            ),
        }
    return rng.choice([{"type": "input_audio"}, {"type": 5}, {"type": {}}, "a string", None])


def messages_part(rng: random.Random):
    kind = rng.choice(["text", "image", "image", "document", "tool", "odd"])
    if kind == "text":
        return {"type": "text", "text": text(rng)}
    if kind == "image":
        return rng.choice(
            [
                messages_image(*IMAGES[rng.choice(list(IMAGES))]),
                messages_image(5, IMAGES["png"][1]),
                {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/cat.png"}},
                {"type": "image", "source": {}},
            ]
        )
    if kind == "document":
        return {
            "type": "document",
            "title": rng.choice(["T", 5, None]),
            "source": rng.choice(
                [
                    {"type": "text", "media_type": "text/plain", "data": text(rng)},
                    {"type": "base64", "media_type": "application/pdf", "data": _b64(b"%PDF")},
                    {
                        "type": "base64",
                        "media_type": rng.choice([5, ["text/plain"], None]),
                        "data": _b64(b"hi"),
                    },
                    {
                        "type": "content",
                        "content": [{"type": "text", "text": "a"}, {"type": "image"}],
                    },
                    {"type": "url", "url": "http://127.0.0.1:9/a.pdf"},
                    {"type": ["text"]},
                    "text",
                ]
            ),
        }
    if kind == "tool":
        return {
            "type": "tool_result",
            "tool_use_id": rng.choice(["t1", 5]),
            "content": rng.choice(["sunny", [messages_part(rng)], 5]),
        }
    return rng.choice([{"type": "video"}, {"type": None}, {"type": ["text"]}, "a string", 7])


def conversation(part: Callable, roles: list) -> Callable[[random.Random], object]:
    """Random turns: many, empty, odd roles, odd content, or not a list at all."""

    def turns(rng: random.Random):
        shape = rng.choice(["many", "odd roles", "empty", "not a list", "odd turns"])
        if shape == "many":
            return [
                {"role": ("user", "assistant")[i % 2], "content": f"turn {i} " + text(rng)}
                for i in range(rng.choice([30, 120, 600]))
            ]
        if shape == "odd roles":
            return [
                {
                    "role": rng.choice(roles),
                    "content": rng.choice([text(rng), [part(rng)], None, ""]),
                }
                for _ in range(rng.randint(1, 4))
            ]
        if shape == "empty":
            return []
        if shape == "not a list":
            return rng.choice(["hello", {"role": "user"}, 5, None])
        return [rng.choice([5, None, "hi", [], {"content": "no role"}]), {"role": "user"}]

    return turns


def content(part: Callable) -> Callable[[random.Random], object]:
    def make(rng: random.Random):
        return rng.choice(
            [
                [part(rng) for _ in range(rng.randint(1, 4))],
                [],
                "",
                None,
                5,
                long_text(rng),
                [{"type": "text", "text": long_text(rng)}],
            ]
        )

    return make


def chat_tools(rng: random.Random) -> dict:
    tools = [
        {
            "type": "function",
            "function": {"name": tool_names(rng), "description": "d", "parameters": schema(rng)},
        }
        for _ in range(rng.choice([1, 2, 200]))
    ]
    return {
        "tools": rng.choice([tools, tools, [{"type": "function"}], {"a": 1}, "x"]),
        "tool_choice": rng.choice(
            [
                "auto",
                "none",
                "required",
                {"type": "function"},
                7,
                *(
                    {"type": "function", "function": {"name": name}}
                    for name in ("get_weather", "missing")
                ),
            ]
        ),
        "parallel_tool_calls": rng.choice([True, False, "no"]),
    }


def responses_tools(rng: random.Random) -> dict:
    tools = [
        {"type": "function", "name": tool_names(rng), "parameters": schema(rng)}
        for _ in range(rng.choice([1, 2, 200]))
    ]
    return {
        "tools": rng.choice([tools, tools, [{"type": "web_search"}], [{"type": 5}], "x"]),
        "tool_choice": rng.choice(
            [
                "auto",
                "none",
                "required",
                {"type": "function", "name": "get_weather"},
                {"type": "function", "name": "missing"},
                7,
            ]
        ),
    }


def messages_tools(rng: random.Random) -> dict:
    tools = [
        {"name": tool_names(rng), "description": "d", "input_schema": schema(rng)}
        for _ in range(rng.choice([1, 2, 200]))
    ]
    return {
        "tools": rng.choice([tools, tools, [{"name": "x"}], [5], "x"]),
        "tool_choice": rng.choice(
            [
                {"type": "auto"},
                {"type": "any"},
                {"type": "none"},
                {"type": "tool", "name": "get_weather"},
                {"type": "tool", "name": "missing"},
                {"type": "auto", "disable_parallel_tool_use": True},
                {"type": "tool"},
                "any",
            ]
        ),
    }


def chat_format(rng: random.Random) -> dict:
    return {
        "response_format": rng.choice(
            [
                {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "s",
                        "schema": schema(rng),
                        "strict": rng.choice([True, False]),
                    },
                },
                {"type": "json_schema", "json_schema": {"schema": schema(rng)}},
                {"type": "json_object"},
                {"type": "text"},
                {"type": "regex"},
                {"type": "bogus"},
            ]
        )
    }


def responses_format(rng: random.Random) -> dict:
    return {
        "text": rng.choice(
            [
                {
                    "format": {
                        "type": "json_schema",
                        "name": "s",
                        "schema": schema(rng),
                        "strict": rng.choice([True, False]),
                    }
                },
                {"format": {"type": "json_object"}},
                {"format": {"type": "text"}},
                {"format": 5},
                5,
            ]
        )
    }


def deepseek_extras(tools: Callable, *more: Callable) -> tuple:
    return (tools, lambda rng: {"so_args": so_args(rng)}, *more)


CHAT = Route(
    "/v1/chat/completions",
    lambda rng: {
        "model": SERVED_NAME,
        "max_tokens": rng.choice(LIMITS),
        **rng.choice([{}, NO_THINKING]),
        "messages": [{"role": "user", "content": text(rng)}],
    },
    {
        **DEEPSEEK,
        "max_tokens": [0, -1, 10**6, 2**63, "4", 4.5],
        "max_completion_tokens": [1, 3, 0, -5, 10**7, "2"],
        "n": [1, 2, 5, 128, 129, 0, 10**9],
        "logit_bias": [{"1": -100}, {"1": 1e300}, {"-1": 5}, {"99999999": 1}, {"x": 1}],
        "logprobs": [True, False],
        "top_logprobs": [0, 2, 20, 21, -1],
        "frequency_penalty": [-2, 0.5, 2, 3],
        "presence_penalty": [-2, 0.5, 2, -3],
        "stop": ["\n", ["a", "b"], [""], [], ["x"] * 100, "x" * 5000],
        "stream_options": [{"include_usage": True}, {"include_usage": "yes"}, {}],
        "reasoning_effort": ["low", "high", "max", "none", "bogus"],
        "user": ["u"],
    },
    limit="max_tokens",
    messages=conversation(
        chat_part, ["user", "assistant", "system", "developer", "tool", "", "robot", None, 5]
    ),
    content=content(chat_part),
    extras=deepseek_extras(chat_tools, chat_format),
    well_formed=lambda body: (
        isinstance(body.get("choices"), list)
        and all("message" in choice for choice in body["choices"])
        and "usage" in body
    ),
    message_of=openai_error,
)
RESPONSES = Route(
    "/v1/responses",
    lambda rng: {
        "model": SERVED_NAME,
        "max_output_tokens": rng.choice(LIMITS),
        **rng.choice([{}, {"reasoning": {"effort": "none"}}]),
        "input": rng.choice([text(rng), [{"role": "user", "content": text(rng)}]]),
    },
    {
        **DEEPSEEK,
        "max_output_tokens": [0, -1, 10**6, "4", 4.5],
        "reasoning": [{"effort": "none"}, {"effort": "high"}, {"effort": "bogus"}, {}],
        "instructions": ["Be brief.", "", 5, "x" * 50_000],
        "previous_response_id": ["resp_missing", "", 5],
        "store": [True, False, "no"],
        "include": [["message.output_text.logprobs"], ["bogus"]],
        "top_logprobs": [0, 3, 20, 21, -1],
        "truncation": ["auto", "disabled", "bogus"],
        "metadata": [{"a": "b"}, {"a": 5}],
        "background": [True],
        "service_tier": ["flex"],
    },
    limit="max_output_tokens",
    messages=conversation(
        responses_part, ["user", "assistant", "system", "developer", "", None, 5]
    ),
    content=content(responses_part),
    extras=deepseek_extras(responses_tools, responses_format),
    well_formed=lambda body: (
        body.get("object") == "response" and isinstance(body.get("output"), list)
    ),
    stream_ends=has_event("response.completed", "response.incomplete"),
    message_of=openai_error,
)
MESSAGES = Route(
    "/v1/messages",
    lambda rng: {
        "model": SERVED_NAME,
        "max_tokens": rng.choice(LIMITS),
        **rng.choice([{}, NO_THINKING]),
        "messages": [{"role": "user", "content": text(rng)}],
    },
    {
        **DEEPSEEK,
        "max_tokens": [0, -1, 10**6, "4", 4.5, None],
        "top_k": [1, 0, -1, -2, 10**9],
        "stop_sequences": [["\n"], [""], "x", [5], ["x"] * 100],
        "system": [
            "Be brief.",
            "",
            [{"type": "text", "text": "hi"}],
            5,
            [messages_image(*IMAGES["png"])],
        ],
        "thinking": [
            {"type": "enabled", "budget_tokens": 1024},
            {"type": "disabled"},
            {"type": "enabled", "budget_tokens": -1},
            {"type": "adaptive"},
        ],
        "metadata": [{"user_id": "u"}, {"user_id": 5}],
    },
    limit="max_tokens",
    messages=conversation(messages_part, ["user", "assistant", "system", "", None, 5]),
    content=content(messages_part),
    extras=deepseek_extras(messages_tools),
    well_formed=lambda body: (
        body.get("type") == "message" and isinstance(body.get("content"), list)
    ),
    stream_ends=has_event("message_stop"),
    message_of=anthropic_error,
)
COMPLETIONS = Route(
    "/v1/completions",
    lambda rng: {"model": SERVED_NAME, "max_tokens": rng.choice(LIMITS), "prompt": text(rng)},
    {
        **SAMPLING,
        "max_tokens": [0, -1, 10**6, "4", 4.5],
        "prompt": [[1, 2, 3], [-1], [10**9], ["a", "b"], [[1, 2], [3]], [], ""],
        "n": [1, 2, 128, 0, -1],
        "logprobs": [0, 5, 21, -1],
        "echo": [True],
        "prompt_logprobs": [0, 5, 21, -1],
        "top_k": [1, 0, -2],
        "min_tokens": [2, 10**6, -1],
        "repetition_penalty": [0, 1.2, -1],
        "ignore_eos": [True],
        "truncate_prompt_tokens": [-1, 0, 5, 10**6],
        "logit_bias": [{"1": -100}, {"x": 1}],
        "structured_outputs": [
            {"regex": "a+"},
            {"json": {"type": "nope"}},
            {"grammar": "root ::= ("},
            {"choice": []},
        ],
        "allowed_token_ids": [[1, 2], [], [-1]],
        "bad_words": [["a"], [""]],
        "suffix": ["x"],
        "stop": [[""], ["a"], "x"],
    },
    limit="max_tokens",
    content=lambda rng: long_text(rng),
    well_formed=lambda body: isinstance(body.get("choices"), list),
)
TOKENIZE = Route(
    "/tokenize",
    lambda rng: rng.choice(
        [
            {"model": SERVED_NAME, "prompt": text(rng)},
            {"model": SERVED_NAME, "messages": [{"role": "user", "content": text(rng)}]},
        ]
    ),
    {
        "add_special_tokens": [True, False],
        "return_token_strs": [True],
        "add_generation_prompt": [True, False],
        "continue_final_message": [True],
        "chat_template": ["{{ 1 / 0 }}", "{% for %}"],
        "chat_template_kwargs": [{"x": 1}],
        "mm_processor_kwargs": [{"max_pixels": -1}],
    },
    messages=CHAT.messages,
    content=CHAT.content,
    well_formed=lambda body: isinstance(body.get("tokens"), list),
)
DETOKENIZE = Route(
    "/detokenize",
    lambda rng: {"model": SERVED_NAME, "tokens": [rng.randrange(1000) for _ in range(5)]},
    {"tokens": [[], [-1], [2**40], ["a"], [1.5], list(range(100_000)), None]},
    well_formed=lambda body: isinstance(body.get("prompt"), str),
)
COUNT_TOKENS = Route(
    "/v1/messages/count_tokens",
    lambda rng: {"model": SERVED_NAME, "messages": [{"role": "user", "content": text(rng)}]},
    {"system": MESSAGES.params["system"], "thinking": MESSAGES.params["thinking"]},
    messages=MESSAGES.messages,
    content=MESSAGES.content,
    extras=(messages_tools,),
    well_formed=lambda body: isinstance(body.get("input_tokens"), int),
)
BATCH_CHAT = Route(
    "/v1/chat/completions/batch",
    lambda rng: {
        "model": SERVED_NAME,
        "max_tokens": rng.choice(LIMITS),
        "messages": [[{"role": "user", "content": text(rng)}] for _ in range(rng.randint(1, 3))],
    },
    {**SAMPLING, "max_tokens": [0, -1, 10**6, "4"], "n": [1, 2, 0], "messages": [[], [[]]]},
    limit="max_tokens",
    extras=(chat_tools, chat_format),
    well_formed=lambda body: isinstance(body.get("choices"), list),
)
INVOCATIONS = Route(
    "/invocations",
    lambda rng: rng.choice(
        [
            {"model": SERVED_NAME, "max_tokens": rng.choice(LIMITS), "prompt": text(rng)},
            {
                "model": SERVED_NAME,
                "max_tokens": rng.choice(LIMITS),
                **NO_THINKING,
                "messages": [{"role": "user", "content": text(rng)}],
            },
        ]
    ),
    {**COMPLETIONS.params, "stop": CHAT.params["stop"] + ["\ud800"]},
    limit="max_tokens",
    messages=CHAT.messages,
    content=CHAT.content,
    extras=(chat_tools, chat_format),
)
"""vLLM's SageMaker route: the chat request model first, then completions and the rest;
its chat bodies render through vLLM's renderer with vLLM's V4.1 encoder, as /tokenize's,
batch chat's and count_tokens' do (patch vision_language_prompts)."""
ROUTES = {
    route.path: route
    for route in (
        CHAT,
        RESPONSES,
        MESSAGES,
        COMPLETIONS,
        TOKENIZE,
        DETOKENIZE,
        COUNT_TOKENS,
        BATCH_CHAT,
        INVOCATIONS,
    )
}


def generic_route(path: str) -> Route:
    """A route without a table of its own: bodies made of the fields other routes take."""
    return Route(
        path,
        lambda rng: {"model": SERVED_NAME, "max_tokens": rng.choice(LIMITS), "prompt": text(rng)},
        {
            **COMPLETIONS.params,
            "messages": [[{"role": "user", "content": "hi"}], []],
            "query": ["q", 5],
            "items": [["a", "b"], 5],
        },
        limit="max_tokens",
        extras=(chat_tools,),
    )


def filled(path: str, rng: random.Random) -> str:
    """A route's path with odd values for its parameters (`/v1/responses/{response_id}`)."""
    return "/".join(
        rng.choice(["resp_missing", "x" * 5000, "%00", "..%2F..", "-1"])
        if part.startswith("{")
        else part
        for part in path.split("/")
    )


# --- cases ------------------------------------------------------------------------------


@dataclass
class Case:
    route: Route
    number: int
    data: bytes
    content_type: str = "application/json"
    changes: tuple[str, ...] = ()

    def __str__(self) -> str:
        shown = self.data[:600].decode("utf-8", "replace")
        more = f"... ({len(self.data)} bytes)" if len(self.data) > 600 else ""
        return (
            f"DEEPINFER_FUZZ_SEED={SEED} {self.route.path} case {self.number} "
            f"({'; '.join(self.changes)}), Content-Type {self.content_type}: {shown}{more}"
        )


def raw_case(route: Route, number: int, rng: random.Random) -> Case:
    """Bytes that are not a valid JSON object, or not sent as JSON."""
    model = SERVED_NAME.encode()
    kind, data, content_type = rng.choice(
        [
            ("not JSON", b'{"model": ', "application/json"),
            ("empty body", b"", "application/json"),
            ("not an object", rng.choice([b"[]", b"5", b'"x"', b"null"]), "application/json"),
            (
                "deep nesting",
                b'{"model": "%s", "x": %s%s}' % (model, b"[" * 100_000, b"]" * 100_000),
                "application/json",
            ),
            (
                "NaN",
                b'{"model": "%s", "temperature": NaN, "max_tokens": 1}' % model,
                "application/json",
            ),
            ("invalid UTF-8", b'{"model": "\xff\xfe"}', "application/json"),
            ("wrong content type", json.dumps(route.base(rng)).encode(), "text/plain"),
        ]
    )
    return Case(route, number, data, content_type, (kind,))


def make_case(route: Route, number: int) -> Case:
    """Case `number` of `route`: a valid body with up to two random changes, or raw bytes
    that are not a JSON object at all."""
    rng = random.Random(f"{SEED}:{route.path}:{number}")
    if rng.random() < 0.08:
        return raw_case(route, number, rng)
    body = route.base(rng)
    changes = tuple(mutate(route, body, rng) for _ in range(rng.choice([0, 1, 1, 2])))
    return Case(route, number, json.dumps(body).encode(), changes=changes)


def mutate(route: Route, body: dict, rng: random.Random) -> str:
    """One random change to `body`; returns what it changed."""
    choices = ["field", "field", "field", "drop"]
    key = "messages" if "messages" in body else "input" if "input" in body else None
    if key and route.messages:
        choices += ["conversation", "content", "content"]
    if route.content and key is None:
        choices.append("prompt")
    if route.extras:
        choices += ["extras", "extras"]
    kind = rng.choice(choices)
    if kind == "field":
        name = rng.choice(list(route.params))
        if name == route.limit:  # never unbounded: a valid limit is a small one
            values = route.params[name] + [v for v in ODD_VALUES if v is not None]
        else:
            values = route.params[name] if route.params[name] and rng.random() < 0.5 else ODD_VALUES
        body[name] = rng.choice(values)
        return f"{name}={json.dumps(body[name])[:40]}"
    if kind == "drop":
        name = rng.choice([k for k in body if k != route.limit] or ["model"])
        body.pop(name, None)
        return f"without {name}"
    if kind == "conversation":
        body[key] = route.messages(rng)
        return f"odd {key}"
    if kind == "content":
        turns = body[key] if isinstance(body[key], list) and body[key] else []
        first = turns[0] if turns and isinstance(turns[0], dict) else {"role": "user"}
        body[key] = [{**first, "content": route.content(rng)}]
        return "odd content"
    if kind == "prompt":
        body["prompt"] = route.content(rng)
        return "odd prompt"
    extra = rng.choice(route.extras)(rng)
    body.update(extra)
    return "+" + "+".join(extra)


# --- checks -----------------------------------------------------------------------------


def problem(base: str, case: Case) -> str | None:
    """What is wrong with the server's answer to `case`, or None."""
    try:
        with requests.post(
            base + case.route.path,
            data=case.data,
            stream=True,
            headers={"Content-Type": case.content_type},
            timeout=REPLY_TIMEOUT_S,
        ) as reply:
            status = reply.status_code
            if not (200 <= status < 300 or 400 <= status < 500):
                return f"status {status}: {reply.text[:1000]}"
            if reply.headers.get("content-type", "").startswith("text/event-stream"):
                return stream_problem(
                    list(reply.iter_lines(decode_unicode=True)), case.route.stream_ends
                )
            if status < 400 and case.route.well_formed is None:
                return None
            try:
                answer = reply.json()
            except ValueError:
                return f"status {status} with a body that is not JSON: {reply.text[:500]!r}"
    except requests.Timeout:
        return f"no answer within {REPLY_TIMEOUT_S} s"
    except requests.RequestException as e:
        return f"the connection dropped: {e!r}"
    if status >= 400:
        return (
            None
            if case.route.message_of(answer)
            else f"status {status} without an error message in the protocol's shape: {answer}"
        )
    return None if case.route.well_formed(answer) else f"a malformed 200: {str(answer)[:1000]}"


def failures(base: str, route: Route) -> list[str]:
    cases = (make_case(route, number) for number in range(CASES))
    return [f"{case}\n  -> {found}" for case in cases if (found := problem(base, case))]


def busy(base: str) -> dict[str, float]:
    """The gauges still above 0 once they have had IDLE_WITHIN_S to settle."""
    deadline = time.monotonic() + IDLE_WITHIN_S
    while True:
        left = {name: value for name in GAUGES if (value := metric(base, name))}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def assert_still_serving(base: str) -> None:
    """/health is 200, nothing is left running or waiting, and a normal request works."""
    assert requests.get(f"{base}/health", timeout=10).status_code == 200
    assert busy(base) == {}, "requests left in the engine"
    reply = requests.post(
        f"{base}/v1/chat/completions",
        timeout=REPLY_TIMEOUT_S,
        json={
            "model": SERVED_NAME,
            "max_tokens": 2,
            **NO_THINKING,
            "messages": [{"role": "user", "content": "still there?"}],
        },
    )
    assert reply.status_code == 200 and reply.json()["choices"], reply.text


@contextlib.contextmanager
def no_traceback_logged(server):
    """The block's requests leave no traceback in the server's log: a client's mistake is
    no server error."""
    logs = (server.stdout, server.stderr)
    before = [path.stat().st_size for path in logs]
    yield
    time.sleep(0.2)  # the log of the last request, if any, is written
    added = "".join(
        path.read_bytes()[size:].decode(errors="replace") for path, size in zip(logs, before)
    )
    assert "Traceback" not in added, added[-3000:]


@pytest.mark.parametrize("path", ROUTES)
def test_random_bodies_get_a_200_or_a_4xx_saying_why(api_server, path):
    with no_traceback_logged(api_server):
        found = failures(api_server, ROUTES[path])
    assert not found, "\n".join(found)
    assert_still_serving(api_server)


def test_every_other_route_the_server_offers(api_server):
    """Every other route of the server's OpenAPI schema: POST routes get bodies made of
    the other routes' fields, GET routes odd path parameters and queries."""
    rng = random.Random(f"{SEED}:other routes")
    paths = requests.get(f"{api_server}/openapi.json", timeout=30).json()["paths"]
    with no_traceback_logged(api_server):
        found = other_routes_failures(api_server, paths, rng)
    assert not found, "\n".join(found)
    assert_still_serving(api_server)


def other_routes_failures(base: str, paths: dict, rng: random.Random) -> list[str]:
    found = []
    for path, operations in paths.items():
        if path in ROUTES or path in NOT_FUZZED:
            continue
        if "post" in operations:
            found += failures(base, generic_route(filled(path, rng)))
        for _ in range(CASES if "get" in operations else 0):
            url = filled(path, rng) + rng.choice(["", "?x=1", "?model=" + "y" * 5000])
            status = requests.get(base + url, timeout=REPLY_TIMEOUT_S).status_code
            if status >= 500:
                found.append(f"GET {url[:200]} -> status {status}")
    return found


# --- what the fuzz found ----------------------------------------------------------------

TURN = {"model": SERVED_NAME, "max_tokens": 4, **NO_THINKING}
FOUND = {  # what it was: (route, body, the 400's message names)
    "a body nested too deeply for Python's JSON reader (a 500)": (
        RESPONSES,
        b'{"model": "%s", "x": %s%s}' % (SERVED_NAME.encode(), b"[" * 100_000, b"]" * 100_000),
        "recursion limit",
    ),
    "a content part whose type is not a string (a TypeError past the front end)": (
        MESSAGES,
        {**TURN, "messages": [{"role": "user", "content": [{"type": ["document"], "text": "hi"}]}]},
        "invalid type: sequence",
    ),
    "a document whose media type is not a string (a 500)": (
        MESSAGES,
        {
            **TURN,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "document",
                            "source": {"type": "base64", "media_type": 5, "data": _b64(b"hi")},
                        }
                    ],
                }
            ],
        },
        "messages[0].content[0]: document of type 5 is not text",
    ),
    "n > 1 with greedy sampling (vLLM's error shape on every protocol)": (
        CHAT,
        {**TURN, "n": 2, "temperature": 0.0, "messages": [{"role": "user", "content": "hi"}]},
        "n must be 1",
    ),
    "an image whose header claims 10 gigapixels (named PIL's ceiling, not the bound)": (
        CHAT,
        {**TURN, "messages": [{"role": "user", "content": [chat_image(*IMAGES["huge header"])]}]},
        "DEEPINFER_MAX_IMAGE_PIXELS",
    ),
}


NAMED_TOOL_WITHOUT_FUNCTION = {
    "tools": [{"type": "function"}],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
}
DEVELOPER_WITHOUT_CONTENT = [{"role": "developer", "content": "", "name": ""}]
UPSTREAM_FOUND = {  # vLLM's own routes, which answered these with a 500
    **{
        f"a developer message with empty content on {route.path} (vLLM's V4.1 encoder asserted)": (
            route,
            {
                **TURN,
                "messages": [DEVELOPER_WITHOUT_CONTENT]
                if route is BATCH_CHAT
                else DEVELOPER_WITHOUT_CONTENT,
            },
            "messages",
        )
        for route in (TOKENIZE, INVOCATIONS, BATCH_CHAT)
    },
    **{
        f"structured_outputs that is not an object on {route.path} (.get() on it)": (
            route,
            {**TURN, "prompt": "hi", "structured_outputs": value},
            "structured_outputs",
        )
        for route, value in ((COMPLETIONS, "x"), (INVOCATIONS, ["regex"]))
    },
    "structured_outputs that is not an object in a chat body on /invocations": (
        INVOCATIONS,
        {**TURN, "messages": [{"role": "user", "content": "hi"}], "structured_outputs": 5},
        "structured_outputs",
    ),
    "a named tool_choice whose tool lacks `function` on /invocations (a KeyError)": (
        INVOCATIONS,
        {**TURN, "messages": [{"role": "user", "content": "hi"}], **NAMED_TOOL_WITHOUT_FUNCTION},
        "tools[0].function",
    ),
    **{
        f"a completions stop string with a lone surrogate ({name})": (
            route,
            b'{"model": "%s", "prompt": "hi", "max_tokens": 1, "stop": ["a", "\\ud800"]}'
            % SERVED_NAME.encode(),
            "stop[1]",
        )
        for name, route in (("completions", COMPLETIONS), ("invocations", INVOCATIONS))
    },
    "a body nested too deeply for Python's JSON reader on /invocations (a RecursionError)": (
        INVOCATIONS,
        b'{"model": "%s", "x": %s%s}' % (SERVED_NAME.encode(), b"[" * 100_000, b"]" * 100_000),
        "levels deep",
    ),
    "a percent-encoded image data URL on /invocations (vLLM's 501: only base64 taken)": (
        INVOCATIONS,
        {
            **TURN,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png,%89PNG"}}
                    ],
                }
            ],
        },
        "Failed to load image",
    ),
}


def assert_a_400_naming(base: str, route: Route, body, named: str) -> None:
    """`body` (bytes, or an object sent as JSON) on `route` is a 400 whose message, in the
    route's error shape, holds `named`."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = requests.post(
        base + route.path,
        data=data,
        timeout=REPLY_TIMEOUT_S,
        headers={"Content-Type": "application/json"},
    )
    assert reply.status_code == 400, reply.text
    assert named in (route.message_of(reply.json()) or ""), reply.text


@pytest.mark.parametrize("found", UPSTREAM_FOUND)
def test_what_the_fuzz_found_on_vllms_routes_is_a_400_naming_the_field(api_server, found):
    """No 5xx and no traceback in the log; the answer names the field."""
    with no_traceback_logged(api_server):
        assert_a_400_naming(api_server, *UPSTREAM_FOUND[found])


@pytest.mark.parametrize("found", FOUND)
def test_what_the_fuzz_found_is_a_400_in_the_protocols_shape(api_server, found):
    with no_traceback_logged(api_server):
        assert_a_400_naming(api_server, *FOUND[found])


# --- clients that go away ---------------------------------------------------------------


def generation_body(path: str, rng: random.Random, stream: bool) -> dict:
    """A request that prefills a fresh prompt (no prefix-cache hit), then generates for a
    while."""
    prompt = uuid.uuid4().hex + " " + " ".join(f"w{i}" for i in range(rng.choice([20, 400])))
    turn = [{"role": "user", "content": prompt}]
    body = {
        "/v1/chat/completions": {"messages": turn, "max_tokens": 200, "logit_bias": {"1": -100}},
        "/v1/responses": {"input": prompt, "max_output_tokens": 200},
        "/v1/messages": {"messages": turn, "max_tokens": 200},
        "/v1/completions": {"prompt": prompt, "max_tokens": 200, "ignore_eos": True},
    }[path]
    return {"model": SERVED_NAME, "stream": stream, **body}


def leave(base: str, path: str, rng: random.Random) -> str:
    """Sends a request and goes away at a random moment, with a FIN or a reset; says when."""
    stream = rng.random() < 0.5
    data = json.dumps(generation_body(path, rng, stream)).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    moment = rng.choice(["in its body", "waiting", "waiting", *["mid-stream"] * 2 * stream])
    reset = rng.random() < 0.5
    url = urlparse(base)
    with socket.create_connection((url.hostname, url.port), timeout=REPLY_TIMEOUT_S) as client:
        if reset:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.sendall(
            head + (data[: rng.randrange(len(data))] if moment == "in its body" else data)
        )
        if moment == "mid-stream":
            wanted, received = rng.randrange(1, 4000), 0
            while received < wanted and (chunk := client.recv(wanted - received)):
                received += len(chunk)
        else:
            time.sleep(rng.uniform(0, 1.5))
    return f"{'stream' if stream else 'whole'} {moment}{' (reset)' if reset else ''}"


def server_errors(base: str, path: str) -> float:
    """The 5xx answers the server counted on `path` (what a client that left never sees)."""
    return metric(base, f'http_requests_total{{handler="{path}",method="POST",status="5xx"}}')


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions"]
)
def test_clients_that_go_away_leave_nothing_running(api_server, path):
    """Half as many clients as fuzz cases leave each route; none is counted as a server
    error (the front end counted one gone while sending its body as a 500), and the
    engine is idle afterwards."""
    rng = random.Random(f"{SEED}:leave:{path}")
    errors = server_errors(api_server, path)
    moments = [leave(api_server, path, rng) for _ in range(max(2, CASES // 2))]
    assert busy(api_server) == {}, f"DEEPINFER_FUZZ_SEED={SEED}: clients left {moments}"
    assert server_errors(api_server, path) == errors, f"DEEPINFER_FUZZ_SEED={SEED}: {moments}"
    assert_still_serving(api_server)


# --- image abuse --------------------------------------------------------------------------

BURST = 6
"""Image requests at the bounds sent at once, with as many over them. The shared server
takes at most 3 images of at most 1 megapixel per request, 2 megapixels and 4 MB
together (conftest.api_server)."""
RSS_PEAK_BUDGET_MIB = 400
"""How far the API server's peak RSS may rise above its RSS before the burst. Measured
on the 2-core build machine: +98 to +178 MiB over five bursts on tcmalloc (on a fresh
server and after the other tests), +139 to +209 MiB over four on glibc's allocator
(DEEPINFER_TCMALLOC=off); the budget leaves about twice that for a loaded machine."""
RSS_SETTLED_MIB = 64
"""How far above its RSS before the burst the API server's RSS may still be IDLE_WITHIN_S
after it. Measured: +9 to +30 MiB on tcmalloc, +4 to +12 MiB on glibc. (Before the heap
was trimmed after every few requests' images rather than only after a large request's,
it stayed ~90 MiB up on tcmalloc; on glibc, before large blocks were mapped on their
own, 40 to 110 MiB more after each burst.)"""
IMAGE_PARTS = {
    CHAT.path: chat_image,
    RESPONSES.path: responses_image,
    MESSAGES.path: messages_image,
}
SOLID = ("image/png", _b64(solid_png(1000, 1000)))


def image_request(path: str, images: list) -> dict:
    """One turn holding `images` ((media type, base64 data) each), answered in one token."""
    parts = [IMAGE_PARTS[path](*image) for image in images]
    if path == RESPONSES.path:
        return {
            "model": SERVED_NAME,
            "max_output_tokens": 1,
            "reasoning": {"effort": "none"},
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Compare them."}, *parts],
                }
            ],
        }
    return {
        "model": SERVED_NAME,
        "max_tokens": 1,
        **NO_THINKING,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Compare them."}, *parts]}
        ],
    }


def noisy(seed: int) -> tuple[str, str]:
    """A megapixel of random pixels: ~3 MB, most of a request's 4 MB."""
    return "image/png", _b64(image_bytes(1000, 1000, seed))


def over_the_bounds() -> list[tuple[list, str]]:
    """Images of a request over one of its bounds, and the bound its refusal names."""
    return [
        ([noisy(100), noisy(101)], "DEEPINFER_MAX_REQUEST_IMAGE_BYTES"),
        ([SOLID] * 3, "DEEPINFER_MAX_REQUEST_IMAGE_PIXELS"),
        ([IMAGES["over the pixel bound"]], "DEEPINFER_MAX_IMAGE_PIXELS"),
        ([IMAGES["huge header"]], "DEEPINFER_MAX_IMAGE_PIXELS"),
        ([IMAGES["png"]] * 4, "--limit-mm-per-prompt"),
    ]


def kib(pid: int, name: str) -> int:
    """A memory figure of /proc/PID/status (VmRSS, VmHWM: the peak RSS)."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(name + ":"))


def test_image_abuse_keeps_the_api_servers_memory_bounded(api_server):
    """The API server (the server's main process, which decodes images) under concurrent
    requests at every image bound and over them: its peak RSS stays within the budget and
    its RSS goes back afterwards."""
    paths, refused = list(IMAGE_PARTS), over_the_bounds()
    at_bounds = [
        (paths[i % 3], image_request(paths[i % 3], [noisy(i), SOLID])) for i in range(BURST)
    ]
    over = [
        (paths[i % 3], image_request(paths[i % 3], refused[i % len(refused)][0]))
        for i in range(BURST)
    ]

    def answer(request):
        path, body = request
        reply = requests.post(api_server + path, json=body, timeout=REPLY_TIMEOUT_S)
        return reply.status_code, error_message(reply.json())

    pid = api_server.process.pid
    before = kib(pid, "VmRSS")
    with open(f"/proc/{pid}/clear_refs", "w") as clear:
        clear.write("5")  # the peak (VmHWM) starts again from the current RSS
    with ThreadPoolExecutor(2 * BURST) as pool:
        answers = list(pool.map(answer, [r for pair in zip(at_bounds, over) for r in pair]))
    peak = kib(pid, "VmHWM")
    assert [status for status, _ in answers[::2]] == [200] * BURST, answers[::2]
    for i, (status, message) in enumerate(answers[1::2]):
        assert status == 400 and refused[i % len(refused)][1] in message, (i, message)
    deadline = time.monotonic() + IDLE_WITHIN_S
    while kib(pid, "VmRSS") - before > RSS_SETTLED_MIB * 1024 and time.monotonic() < deadline:
        time.sleep(0.2)
    after = kib(pid, "VmRSS")
    print(
        f"API server RSS: {before // 1024} MiB before, peak {peak // 1024} MiB, "
        f"{after // 1024} MiB after"
    )
    assert peak - before <= RSS_PEAK_BUDGET_MIB * 1024
    assert after - before <= RSS_SETTLED_MIB * 1024
