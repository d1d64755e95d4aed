"""serving/lone_surrogates: a JSON body holding a lone surrogate is refused on vLLM's
routes with vLLM's 400 naming the field; every other body reaches the route unchanged."""

import asyncio
import json

import pytest

from vllm_deepinfer.serving.lone_surrogates import LoneSurrogateGuard, lone_surrogate_at

pytestmark = pytest.mark.unit


def call(body: bytes, path: str = "/v1/completions", chunk: int = 7) -> tuple[int, bytes, list]:
    """(status, response body, the bodies the route read) of a POST through the guard; the
    request body arrives in chunks of `chunk` bytes."""
    seen = []

    async def route(scope, receive, send):
        data = b""
        while True:
            message = await receive()
            data += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen.append(data)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    parts = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [
        {"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
        for i, part in enumerate(parts)
    ]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    guard = LoneSurrogateGuard(route, skip=("/v1/chat/completions",))
    asyncio.run(guard({"type": "http", "method": "POST", "path": path}, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), seen


def test_a_lone_surrogate_is_refused_naming_its_field():
    status, reply, seen = call(b'{"prompt": "hi", "stop": ["a", "\\ud800"]}')
    assert status == 400 and seen == []
    error = json.loads(reply)["error"]
    assert error["param"] == "stop[1]" and error["code"] == 400
    assert error["type"] == "BadRequestError" and "lone UTF-16 surrogate" in error["message"]


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "fox \\ud83e\\udd8a", "stop": ["\\u00e9"]}',  # a pair: one character
        b'{"prompt": "no escapes at all"}',
        b'{"prompt": "\\ud800',  # not JSON: the route says so
        b"",
    ],
)
def test_other_bodies_reach_the_route_unchanged(body):
    status, reply, seen = call(body)
    assert (status, reply, seen) == (200, b"ok", [body])


def test_the_deepseek_routes_check_their_own_bodies():
    body = b'{"messages": [{"role": "user", "content": "\\udc00"}]}'
    assert call(body, path="/v1/chat/completions")[2] == [body]


def test_paths_name_keys_list_items_and_nesting():
    assert lone_surrogate_at({"a": [{"b": "x"}, {"c": "y\udfff"}]}) == "a[1].c"
    assert lone_surrogate_at({"a": {"\ud800": 1}}) == "a: a key"
    assert lone_surrogate_at("\ud800") == "the body"
    assert lone_surrogate_at({"a": ["fine", 5, None]}) is None
