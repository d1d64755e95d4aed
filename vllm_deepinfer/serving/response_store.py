"""Responses this server produced, for `previous_response_id`.

A Responses request naming a previous response continues its conversation: the previous
request's input items and the previous response's output items come before the new
input (the previous `instructions` are not carried over, as OpenAI specifies). Responses
are kept in memory, the most recent `capacity` of them (`store: false` keeps none); an
unknown or evicted id is a 404."""

from __future__ import annotations

import threading
from collections import OrderedDict

from vllm_deepinfer.serving.request_options import RequestFieldError

DEFAULT_CAPACITY = 1024


class UnknownResponse(KeyError):
    """A previous_response_id this server does not hold."""


def _input_items(value) -> list:
    """The Responses `input` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else []


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._items: OrderedDict[str, list] = OrderedDict()
        self._lock = threading.Lock()

    def continued(self, body: dict) -> dict | None:
        """The request body with the named previous response's conversation before its
        input, or None when it names none. Raises UnknownResponse (RequestFieldError for
        an id that is not a string)."""
        previous = body.get("previous_response_id")
        if previous is None:
            return None
        if not isinstance(previous, str):
            raise RequestFieldError(f"previous_response_id must be a string, got {previous!r}")
        with self._lock:
            history = self._items.get(previous)
            if history is None:
                raise UnknownResponse(previous)
            self._items.move_to_end(previous)
        changed = {**body, "input": [*history, *_input_items(body.get("input"))]}
        changed.pop("previous_response_id")
        return changed

    def remember(self, response_id: str, body: dict, output: list) -> None:
        """Keeps the conversation up to this response: `body` is the request as run
        (previous conversation included), `output` the response's output items."""
        with self._lock:
            self._items[response_id] = [*_input_items(body.get("input")), *output]
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
