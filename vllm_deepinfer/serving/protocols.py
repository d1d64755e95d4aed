"""The three DeepSeek API protocols: how each is parsed, streamed, aggregated and how its
errors look. Everything protocol-specific lives in this table."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Callable

import deepseek_recipe as dr


@dataclass(frozen=True)
class ApiProtocol:
    path: str
    request_cls: type
    response_cls: type
    id_prefix: str
    anthropic_errors: bool
    make_generator: Callable[[object, object, str, str, dr.ConversionOptions], object]

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
        name = self.response_cls.sse_event_name(event)
        data = event.to_json()
        return f"event: {name}\ndata: {data}\n\n" if name else f"data: {data}\n\n"

    def sse_done(self) -> str | None:
        done = self.response_cls.sse_done_data()
        return f"data: {done}\n\n" if done else None


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
                   "chatcmpl-", False, _chat_generator)
RESPONSES = ApiProtocol("/v1/responses", dr.ResponsesRequest, dr.ResponsesResponse, "resp_",
                        False, _responses_generator)
MESSAGES = ApiProtocol("/v1/messages", dr.MessagesRequest, dr.MessagesResponse, "msg_", True,
                       _messages_generator)
PROTOCOLS = (CHAT, RESPONSES, MESSAGES)


def recipe_error_message(error: dr.ConversionError) -> str:
    """The message inside a ConversionError's (OpenAI-shaped) body."""
    try:
        return json.loads(error.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return str(error)
