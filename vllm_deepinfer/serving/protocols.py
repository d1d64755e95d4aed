"""The three DeepSeek API protocols: how each is parsed, streamed, aggregated and how its
errors look. Everything protocol-specific lives in this table."""
from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass
from typing import Callable

import deepseek_recipe as dr

from vllm_deepinfer.serving.request_options import (CHAT_FIELDS, MESSAGES_FIELDS,
                                                     RESPONSES_FIELDS, RequestField, chat_body)


@dataclass(frozen=True)
class ApiProtocol:
    path: str
    request_cls: type
    response_cls: type
    id_prefix: str
    anthropic_errors: bool
    make_generator: Callable[[object, object, str, str, dr.ConversionOptions], object]
    # Fields the recipe drops, read from the body into SamplingParams (request_options.py)
    request_fields: tuple[RequestField, ...] = ()
    # The body as the recipe takes it, or None when unchanged (may raise RequestFieldError)
    adapt_body: Callable[[dict], dict | None] | None = None

    def new_id(self) -> str:
        return f"{self.id_prefix}{uuid.uuid4().hex}"

    def error_body(self, status: int, message: str) -> dict:
        """The protocol's own error shape (OpenAI-style or Anthropic-style)."""
        if self.anthropic_errors:
            kind = {404: "not_found_error", 413: "request_too_large"}.get(
                status, "invalid_request_error" if status < 500 else "api_error")
            return {"type": "error", "error": {"type": kind, "message": message}}
        kind = "invalid_request_error" if status < 500 else "internal_server_error"
        code = "model_not_found" if status == 404 else kind
        return {"error": {"message": message, "type": kind, "param": None, "code": code}}

    def sse(self, event) -> str:
        if isinstance(event, UsageChunk):
            name = None
        else:
            name = self.response_cls.sse_event_name(
                event.chunk if isinstance(event, ChoiceChunk) else event)
        data = event.to_json()
        return f"event: {name}\ndata: {data}\n\n" if name else f"data: {data}\n\n"

    def sse_done(self) -> str | None:
        done = self.response_cls.sse_done_data()
        return f"data: {done}\n\n" if done else None


def _compact_json(data: dict) -> str:
    """JSON as the recipe writes its own chunks (no spaces, UTF-8 kept)."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


class ChoiceChunk:
    """A Chat chunk of choice `index` of an `n` > 1 request: the recipe's processor, one
    per choice, writes choice 0. Usage moves to one final UsageChunk, as OpenAI sends it."""

    def __init__(self, chunk, index: int):
        self.chunk, self.index = chunk, index
        self.data = json.loads(chunk.to_json())
        self.usage = self.data.get("usage")
        for choice in self.data.get("choices", ()):
            choice["index"] = index
        self.data["usage"] = None

    def to_json(self) -> str:
        return _compact_json(self.data)


class UsageChunk:
    """The last chunk of a streamed `n` > 1 Chat request: no choices, the usage of all."""

    def __init__(self, template: ChoiceChunk, usages: list[dict]):
        self.data = {**template.data, "choices": [], "usage": sum_usage(usages)}

    def to_json(self) -> str:
        return _compact_json(self.data)


def sum_usage(usages: list[dict]) -> dict:
    """The usage of several choices of one prompt: the prompt counted once, completion
    counts (and their details) summed."""
    total = copy.deepcopy(usages[0])
    for usage in usages[1:]:
        total["completion_tokens"] += usage["completion_tokens"]
        for key, value in (usage.get("completion_tokens_details") or {}).items():
            if isinstance(value, int):
                details = total.setdefault("completion_tokens_details", {})
                details[key] = (details.get(key) or 0) + value
    total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
    return total


class MultiChoiceResponse:
    """A non-streamed Chat response of `n` choices, each accumulated by the recipe's own
    response from its ChoiceChunks."""

    def __init__(self, responses: list):
        self.responses = responses

    def accumulate(self, event) -> None:
        if isinstance(event, ChoiceChunk):
            self.responses[event.index].accumulate(event.chunk)

    def to_json(self) -> str:
        parts = [json.loads(response.to_json()) for response in self.responses]
        merged = parts[0]
        merged["choices"] = [{**choice, "index": index}
                             for index, part in enumerate(parts) for choice in part["choices"]]
        if all(part.get("usage") for part in parts):
            merged["usage"] = sum_usage([part["usage"] for part in parts])
        return _compact_json(merged)


def _chat_generator(request, converted, request_id, model, options):
    return dr.ChatCompletionRequest.chunk_generator(converted, request_id, model)


def _responses_generator(request, converted, request_id, model, options):
    # The tool namespace map and echo come from the request, which converting consumes:
    # they are read by the caller before conversion and passed in as `request`.
    namespace_map, echo = request
    return (dr.ResponsesRequest.chunk_generator(converted, request_id, model)
            .with_namespace_tool_map(namespace_map).with_echo(echo))


def _messages_generator(request, converted, request_id, model, options):
    return dr.MessagesRequest.chunk_generator(converted, request_id, model)


CHAT = ApiProtocol("/v1/chat/completions", dr.ChatCompletionRequest, dr.ChatCompletionResponse,
                   "chatcmpl-", False, _chat_generator, CHAT_FIELDS, chat_body)
RESPONSES = ApiProtocol("/v1/responses", dr.ResponsesRequest, dr.ResponsesResponse, "resp_",
                        False, _responses_generator, RESPONSES_FIELDS)
MESSAGES = ApiProtocol("/v1/messages", dr.MessagesRequest, dr.MessagesResponse, "msg_", True,
                       _messages_generator, MESSAGES_FIELDS)
PROTOCOLS = (CHAT, RESPONSES, MESSAGES)


def recipe_error_message(error: dr.ConversionError) -> str:
    """The message inside a ConversionError's (OpenAI-shaped) body."""
    try:
        return json.loads(error.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return str(error)
