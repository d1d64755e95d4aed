"""The three DeepSeek API protocols: how each is parsed, streamed, aggregated and how its
errors look. Everything protocol-specific lives in this table."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import deepseek_recipe as dr

from vllm_deepinfer.serving.documents import with_text_documents
from vllm_deepinfer.serving.images import refuse_system_images
from vllm_deepinfer.serving.request_options import (
    CHAT_FIELDS,
    MESSAGES_FIELDS,
    RESPONSES_FIELDS,
    RequestField,
    chat_body,
)


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
    # The body as the recipe takes it, or None when unchanged (may raise RequestFieldError,
    # or ImageRejected)
    adapt_body: Callable[[dict], dict | None] | None = None
    # Streams usage in a last chunk of its own, when asked for (OpenAI Chat)
    usage_chunk: bool = False

    def new_id(self) -> str:
        return f"{self.id_prefix}{uuid.uuid4().hex}"

    def error_body(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> dict:
        """The protocol's own error shape (OpenAI-style, with `code` and `param` where
        given, or Anthropic-style)."""
        if self.anthropic_errors:
            kind = {404: "not_found_error", 413: "request_too_large"}.get(
                status, "invalid_request_error" if status < 500 else "api_error"
            )
            return {"type": "error", "error": {"type": kind, "message": message}}
        kind = "invalid_request_error" if status < 500 else "internal_server_error"
        return {"error": {"message": message, "type": kind, "param": param, "code": code or kind}}

    def sse(self, event) -> str:
        name = (
            None if isinstance(event, UsageChunk) else self.response_cls.sse_event_name(event.chunk)
        )
        data = event.to_json()
        return f"event: {name}\ndata: {data}\n\n" if name else f"data: {data}\n\n"

    def sse_error(self, body: dict) -> str:
        """An error that ends a stream already under way. Anthropic's SDKs raise only on a
        named `error` event (they skip unnamed ones, and a cut answer would look whole);
        OpenAI's read an `error` object from a plain data line."""
        data = _compact_json(body)
        return f"event: error\ndata: {data}\n\n" if self.anthropic_errors else f"data: {data}\n\n"

    def sse_done(self) -> str | None:
        done = self.response_cls.sse_done_data()
        return f"data: {done}\n\n" if done else None


def _compact_json(data: dict) -> str:
    """JSON as the recipe writes its own chunks (no spaces, UTF-8 kept)."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


class ServedChunk:
    """A recipe chunk as this server sends it: `chunk` is the recipe's object (aggregated
    by the recipe's responses, named by its SSE event), `index` its choice and `data`,
    for streams, its JSON with the service's corrections (ChatService.served)."""

    def __init__(self, chunk, index: int, data: dict | None = None):
        self.chunk, self.index, self.data = chunk, index, data

    def to_json(self) -> str:
        return _compact_json(self.data) if self.data is not None else self.chunk.to_json()


class UsageChunk:
    """The last chunk of a Chat stream asked for usage (`stream_options.include_usage`):
    no choices, the usage of all choices, as OpenAI sends it."""

    def __init__(self, data: dict):
        self.data = data

    def to_json(self) -> str:
        return _compact_json(self.data)


class AggregatedResponse:
    """A non-streamed response: the recipe's own response objects, one per choice,
    accumulate their choice's chunks; `finish` corrects the JSON (ChatService.finished)."""

    def __init__(self, responses: list, finish: Callable[[dict], dict]):
        self.responses, self.finish = responses, finish

    def accumulate(self, event: ServedChunk) -> None:
        self.responses[event.index].accumulate(event.chunk)

    def to_json(self) -> str:
        parts = [json.loads(response.to_json()) for response in self.responses]
        merged = parts[0]
        if len(parts) > 1:
            merged["choices"] = [
                {**choice, "index": index}
                for index, part in enumerate(parts)
                for choice in part["choices"]
            ]
        return _compact_json(self.finish(merged))


def _chat_generator(request, converted, request_id, model, options):
    return dr.ChatCompletionRequest.chunk_generator(converted, request_id, model)


def _responses_generator(request, converted, request_id, model, options):
    # The tool namespace map and echo come from the request, which converting consumes:
    # they are read by the caller before conversion and passed in as `request`.
    namespace_map, echo = request
    return (
        dr.ResponsesRequest.chunk_generator(converted, request_id, model)
        .with_namespace_tool_map(namespace_map)
        .with_echo(echo)
    )


def _messages_generator(request, converted, request_id, model, options):
    return dr.MessagesRequest.chunk_generator(converted, request_id, model)


def _messages_body(body: dict) -> dict | None:
    refuse_system_images(body)
    return with_text_documents(body, "messages", "text")


def _chat_body(body: dict) -> dict | None:
    adapted = chat_body(body)
    return with_text_documents(adapted or body, "messages", "text") or adapted


CHAT = ApiProtocol(
    "/v1/chat/completions",
    dr.ChatCompletionRequest,
    dr.ChatCompletionResponse,
    "chatcmpl-",
    False,
    _chat_generator,
    CHAT_FIELDS,
    _chat_body,
    usage_chunk=True,
)
RESPONSES = ApiProtocol(
    "/v1/responses",
    dr.ResponsesRequest,
    dr.ResponsesResponse,
    "resp_",
    False,
    _responses_generator,
    RESPONSES_FIELDS,
    lambda body: with_text_documents(body, "input", "input_text"),
)
MESSAGES = ApiProtocol(
    "/v1/messages",
    dr.MessagesRequest,
    dr.MessagesResponse,
    "msg_",
    True,
    _messages_generator,
    MESSAGES_FIELDS,
    _messages_body,
)
PROTOCOLS = (CHAT, RESPONSES, MESSAGES)


def recipe_error_message(error: dr.ConversionError) -> str:
    """The message inside a ConversionError's (OpenAI-shaped) body."""
    try:
        return json.loads(error.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return str(error)
