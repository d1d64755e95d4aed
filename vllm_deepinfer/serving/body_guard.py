"""JSON bodies vLLM's own routes cannot take are refused with a 400 naming the field,
before vLLM's handlers run, in their error shape. The DeepSeek API routes read their
bodies through deepseek-recipe, which refuses the same two things itself.

- A lone surrogate. JSON can spell a UTF-16 surrogate alone (`"\\ud800"`); Python decodes
  it into a string that no UTF-8 encoder takes. vLLM's routes pass such strings on until
  something encodes them: a completions `stop` string reaches the engine client's msgpack
  encoding, which fails, and the client gets a 500 with an empty message. Text with a
  lone surrogate is not text, whichever field holds it.
- Nesting too deep. `/invocations` decodes its body itself and lets the RecursionError
  of a body nested deeper than Python's recursion limit out as a 500; vLLM's other routes
  answer it with a 400 that only says the body could not be parsed, and a body that
  decodes may still recurse too deep in what reads it later (validation, json.dumps).
  Every route gets the one limit deepseek-recipe's reader (serde_json) has.
"""

from __future__ import annotations

import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Arrays and objects inside one another, the body itself the first: serde_json's limit.
MAX_JSON_DEPTH = 127
# A surrogate's escape in the raw JSON text: only then can the decoded body hold one.
_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")
LONE_SURROGATE = (
    "holds a lone UTF-16 surrogate (an escape from \\ud800 to \\udfff without its pair), "
    "which is not a character: the text cannot be encoded"
)
TOO_DEEP = (
    f"nests arrays and objects more than {MAX_JSON_DEPTH} levels deep, more than this server reads"
)


def problem_in(value) -> tuple[str, str] | None:
    """(where, what) of the first thing in a decoded JSON value that vLLM's routes cannot
    take: the path (`stop[0]`, `messages[1].content`) of a string or key holding a lone
    surrogate (a pair decodes into one character, so any surrogate left is alone), or of
    an array or object too deep; None if there is none."""
    stack: list[tuple[str, object, int]] = [("", value, 1)]
    while stack:
        path, item, depth = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path or "the body", LONE_SURROGATE
        elif isinstance(item, (dict, list)) and depth > MAX_JSON_DEPTH:
            return path or "the body", TOO_DEEP
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                if _SURROGATE.search(key):
                    return f"{path or 'the body'}: a key", LONE_SURROGATE
                stack.append((f"{path}.{key}" if path else str(key), child, depth + 1))
        elif isinstance(item, list):
            stack.extend(
                (f"{path}[{i}]", child, depth + 1) for i, child in reversed(list(enumerate(item)))
            )
    return None


def body_problem(body: bytes | bytearray) -> tuple[str, str] | None:
    """problem_in of the body's JSON; None for a body that is no JSON (the route says
    so). Decoded only when its raw text could hold a problem: a surrogate's escape, or
    as many brackets as the depth limit."""
    if not _ESCAPE.search(body) and body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return None
    try:
        value = json.loads(body)
    except RecursionError:
        return "the body", TOO_DEEP
    except ValueError:
        return None
    return problem_in(value)


def refusal(where: str, what: str) -> bytes:
    """vLLM's error body (its ErrorResponse) for `what` is wrong at `where`."""
    error = {"message": f"{where}: {what}", "type": "BadRequestError", "param": where, "code": 400}
    return json.dumps({"error": error}).encode()


class BodyGuard:
    """ASGI middleware: POST bodies of the routes not in `skip` are read, checked, and
    passed on unchanged, or refused."""

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
        problem = body_problem(body)
        if problem is not None:
            content = refusal(*problem)
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
