"""A JSON body holding a lone surrogate is refused with a 400 naming the field, on vLLM's
own routes.

JSON can spell a UTF-16 surrogate alone (`"\\ud800"`); Python decodes it into a string
that no UTF-8 encoder takes. vLLM's routes pass such strings on until something encodes
them: a completions `stop` string reaches the engine client's msgpack encoding, which
fails, and the client gets a 500 with an empty message. Text with a lone surrogate is not
text, whichever field holds it: the front end refuses it before vLLM's handlers run, in
their error shape. The DeepSeek API routes check their own bodies."""

from __future__ import annotations

import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A surrogate's escape in the raw JSON text: only then can the decoded body hold one.
_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_at(value) -> str | None:
    """The path (`stop[0]`, `messages[1].content`) of the first string or key of a JSON
    value holding a lone surrogate; None if none does. (A pair decodes into one character,
    so any surrogate left is alone.)"""
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path or "the body"
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                child_path = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    return f"{path or 'the body'}: a key"
                stack.append((child_path, child))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(item))))
    return None


def refusal(path: str) -> bytes:
    """vLLM's error body (its ErrorResponse) for a lone surrogate at `path`."""
    message = (
        f"{path}: holds a lone UTF-16 surrogate (an escape from \\ud800 to \\udfff without "
        "its pair), which is not a character: the text cannot be encoded"
    )
    error = {"message": message, "type": "BadRequestError", "param": path, "code": 400}
    return json.dumps({"error": error}).encode()


class LoneSurrogateGuard:
    """ASGI middleware: POST bodies of the routes not in `skip` are read, checked where
    their text holds a surrogate's escape, and passed on unchanged, or refused."""

    def __init__(self, app: ASGIApp, skip: tuple[str, ...] = ()):
        self.app = app
        self.skip = frozenset(skip)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] in self.skip:
            await self.app(scope, receive, send)
            return
        received: list[Message] = []
        body = bytearray()
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        path = None
        if _ESCAPE.search(body):
            try:
                path = lone_surrogate_at(json.loads(body))
            except (ValueError, RecursionError):
                path = None  # not JSON this reader takes: the route answers that
        if path is not None:
            content = refusal(path)
            await send(
                {
                    "type": "http.response.start",
                    "status": 400,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(content)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": content})
            return

        async def replay() -> Message:
            return received.pop(0) if received else await receive()

        await self.app(scope, replay, send)
