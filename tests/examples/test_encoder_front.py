"""The encoder front finds every image of a request, in order, on each API's shape, and
nothing that is not an image."""

import importlib.util
import os

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def front():
    spec = importlib.util.spec_from_file_location(
        "encoder_front", os.path.join(ROOT, "examples", "encoder_front.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chat_completions_images(front):
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:a"}},
                    {"type": "text", "text": "and"},
                    {"type": "image_url", "image_url": "http://b"},
                ],
            },
            {"role": "assistant", "content": None},
        ]
    }
    assert front.image_urls("/v1/chat/completions", body) == ["data:a", "http://b"]


def test_responses_images(front):
    body = {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "x"},
                    {"type": "input_image", "image_url": "data:c"},
                    {"type": "input_image", "file_id": "f"},
                ],
            },
            "plain item",
        ]
    }
    assert front.image_urls("/v1/responses", body) == ["data:c"]
    assert front.image_urls("/v1/responses", {"input": "text only"}) == []


def test_messages_images(front):
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"},
                    },
                    {"type": "image", "source": {"type": "url", "url": "https://d"}},
                    {"type": "text", "text": "compare"},
                ],
            }
        ]
    }
    assert front.image_urls("/v1/messages", body) == ["data:image/png;base64,QUJD", "https://d"]


def test_no_images_in_odd_bodies(front):
    for body in (
        {},
        {"messages": "x"},
        {"messages": [1, {"content": [None, 2]}]},
        {"prompt": "text"},
    ):
        assert front.image_urls("/v1/chat/completions", body) == []


def test_body_over_the_limit_is_refused(front):
    """A body over --max-body-bytes gets a 413 whether its length is declared or it is
    streamed, and nothing of it is forwarded; one within the limit reaches the router."""
    import httpx
    from fastapi.testclient import TestClient

    forwarded = []

    def upstream(request: httpx.Request) -> httpx.Response:
        forwarded.append((str(request.url), request.content))
        return httpx.Response(
            200,
            headers={"content-type": "application/json"},
            stream=httpx.ByteStream(b'{"ok": true}'),
        )

    app = front.build_app(
        "http://e",
        "http://r",
        "http://p",
        "http://d",
        5.0,
        max_body_bytes=1000,
        transport=httpx.MockTransport(upstream),
    )
    with TestClient(app) as client:
        declared = client.post("/v1/completions", content=b'{"prompt": "' + b"x" * 2000 + b'"}')
        assert declared.status_code == 413

        def chunks():
            yield b'{"prompt": "'
            for _ in range(5):
                yield b"x" * 400
            yield b'"}'

        streamed = client.post("/v1/completions", content=chunks())
        assert streamed.status_code == 413
        assert "max-body-bytes" in streamed.json()["error"]["message"]
        assert forwarded == []

        small = b'{"prompt": "' + b"x" * 900 + b'"}'
        assert len(small) <= 1000
        assert client.post("/v1/completions", content=small).json() == {"ok": True}
    assert forwarded == [("http://r/v1/completions", small)]
