"""serving/body_guard: a JSON body holding a lone surrogate, or nested deeper than the
limit, is refused on vLLM's routes with vLLM's 400 naming the field; every other body
reaches the route unchanged."""

import asyncio
import json

import pytest

from vllm_deepinfer.serving.body_guard import MAX_JSON_DEPTH, BodyGuard, problem_in

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

    guard = BodyGuard(route, skip=("/v1/chat/completions",))
    asyncio.run(guard({"type": "http", "method": "POST", "path": path}, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), seen


def refused(body: bytes) -> dict:
    """The error of the guard's 400 for `body`; the route never saw it."""
    status, reply, seen = call(body)
    assert status == 400 and seen == [], (status, reply)
    error = json.loads(reply)["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    assert error["message"].startswith(error["param"] + ": ")
    return error


def nested(levels: int) -> bytes:
    """A body whose field `x` holds arrays `levels` deep (the body itself one level more)."""
    return b'{"prompt": "hi", "x": %s%s}' % (b"[" * levels, b"]" * levels)


def test_a_lone_surrogate_is_refused_naming_its_field():
    error = refused(b'{"prompt": "hi", "stop": ["a", "\\ud800"]}')
    assert error["param"] == "stop[1]" and "lone UTF-16 surrogate" in error["message"]


def test_a_body_nested_deeper_than_the_limit_is_refused_naming_where():
    error = refused(nested(MAX_JSON_DEPTH))
    assert error["param"] == "x" + "[0]" * (MAX_JSON_DEPTH - 1)
    assert f"more than {MAX_JSON_DEPTH} levels deep" in error["message"]


def test_a_body_too_deep_for_pythons_reader_is_refused():
    """Deeper than the recursion limit: the decoding itself fails (vLLM's /invocations
    answered it with a 500)."""
    error = refused(nested(100_000))
    assert error["param"] == "the body" and "levels deep" in error["message"]


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "fox \\ud83e\\udd8a", "stop": ["\\u00e9"]}',  # a pair: one character
        b'{"prompt": "no escapes at all"}',
        b'{"prompt": "\\ud800',  # not JSON: the route says so
        b"[" * 500,  # nor is this
        nested(MAX_JSON_DEPTH - 1),  # at the limit
        b'{"prompt": [%s]}' % b",".join([b"[1]"] * 1000),  # many brackets, shallow
        b"",
    ],
)
def test_other_bodies_reach_the_route_unchanged(body):
    status, reply, seen = call(body)
    assert (status, reply, seen) == (200, b"ok", [body])


def test_the_deepseek_routes_check_their_own_bodies():
    for body in (b'{"messages": [{"role": "user", "content": "\\udc00"}]}', nested(1000)):
        assert call(body, path="/v1/chat/completions")[2] == [body]


def test_paths_name_keys_list_items_and_nesting():
    assert problem_in({"a": [{"b": "x"}, {"c": "y\udfff"}]})[0] == "a[1].c"
    assert problem_in({"a": {"\ud800": 1}})[0] == "a: a key"
    assert problem_in("\ud800")[0] == "the body"
    assert problem_in({"a": ["fine", 5, None]}) is None
    deep = inner = []
    for _ in range(MAX_JSON_DEPTH):
        inner.append({"k": []})
        inner = inner[0]["k"]
    assert problem_in(deep)[0] == "[0].k" * (MAX_JSON_DEPTH // 2) + "[0]" * (MAX_JSON_DEPTH % 2)
