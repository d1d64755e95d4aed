"""Images through the three DeepSeek API routes on a real server, by value only: Chat
Completions (`image_url` data URLs) and Responses (`input_image`) with the openai client,
Messages (base64 `image` blocks) with the anthropic client; and vLLM's own /tokenize. Bad
images get a 400 naming the problem and the server keeps serving; an image URL is never
fetched, on any route."""

import base64
import http.server
import io
import json
import os
import threading

import pytest
import requests
from PIL import Image

from helpers import NO_THINKING, SERVED_NAME, data_url, image_bytes, metric, solid_png
from vllm_deepinfer.model.deepseek_v41.args import IMAGE_TOKEN_ID
from vllm_deepinfer.model.deepseek_v41.image_processing import image_span_length

pytestmark = pytest.mark.server


def chat(oa, *parts, **extra):
    content = [{"type": "text", "text": "Describe the picture."}, *parts]
    return oa.chat.completions.create(
        model=SERVED_NAME,
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
        extra_body=NO_THINKING,
        messages=[{"role": "user", "content": content}],
        **extra,
    )


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


@pytest.fixture(scope="module")
def span(vision_checkpoint):
    """Prompt tokens an image takes on the served checkpoint."""
    from vllm.transformers_utils.configs.deepseek_v41 import DeepseekV41Config

    with open(os.path.join(vision_checkpoint, "config.json")) as f:
        config = DeepseekV41Config(**json.load(f))
    return lambda data: image_span_length(config, Image.open(io.BytesIO(data)).size)


def counted(api_server, request):
    """The response to `request()` and the prompt tokens the engine ran for it."""
    before = metric(api_server, "vllm:prompt_tokens_total")
    response = request()
    return response, metric(api_server, "vllm:prompt_tokens_total") - before


def takes_span(with_images: int, text_only: int, spans: int) -> bool:
    """The image request's prompt is the text one's, plus each image's whole span, plus
    the few separator tokens the recipe renders around image placeholders."""
    return 0 <= with_images - text_only - spans <= 4


def test_chat_completions_image_url(oa, api_server, span):
    picture, other = image_bytes(120, 90, 0), image_bytes(120, 90, 1)
    text_only = chat(oa)
    seen, ran = counted(api_server, lambda: chat(oa, image_part(picture)))
    again = chat(oa, image_part(picture))
    different = chat(oa, image_part(other))
    assert seen.usage.prompt_tokens == ran
    assert takes_span(ran, text_only.usage.prompt_tokens, span(picture))

    def logprobs(response):
        return [(t.token, round(t.logprob, 4)) for t in response.choices[0].logprobs.content]

    assert logprobs(seen) == logprobs(again)
    assert logprobs(seen) != logprobs(different)  # the image reaches the model
    assert logprobs(seen) != logprobs(text_only)


def test_vllms_own_routes_place_an_images_whole_span(api_server, span):
    """/tokenize renders with vLLM's V4.1 encoder on the vision checkpoint (patch
    vision_language_prompts): its image placeholder is the checkpoint's image token, and
    the processor widens it to the image's span."""
    picture = image_bytes(120, 90, 0)

    def tokens(*parts):
        content = [*parts, {"type": "text", "text": "Describe the picture."}]
        reply = requests.post(
            f"{api_server}/tokenize",
            timeout=60,
            json={"model": SERVED_NAME, "messages": [{"role": "user", "content": content}]},
        )
        assert reply.status_code == 200, reply.text
        return reply.json()["tokens"]

    with_image, text_only = tokens(image_part(picture)), tokens()
    assert with_image.count(IMAGE_TOKEN_ID) == span(picture)
    assert takes_span(len(with_image), len(text_only), span(picture))


def test_responses_input_image(oa, api_server, span):
    picture = image_bytes(64, 160, 2, "JPEG")

    def respond(*parts):
        return oa.responses.create(
            model=SERVED_NAME,
            max_output_tokens=6,
            temperature=0.0,
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "What is this?"}, *parts],
                }
            ],
        )

    response, ran = counted(
        api_server,
        lambda: respond({"type": "input_image", "image_url": data_url(picture, "image/jpeg")}),
    )
    assert response.status in ("completed", "incomplete")  # 6 tokens may cut it short
    assert response.usage.input_tokens == ran
    assert takes_span(ran, respond().usage.input_tokens, span(picture))


def test_messages_base64_image_blocks(claude, api_server, span):
    first, second = image_bytes(100, 100, 3, "WEBP"), image_bytes(150, 50, 4, "GIF")
    blocks = [
        {
            "type": "image",
            "source": {
                "type": "base64",
                "media_type": media,
                "data": base64.b64encode(data).decode(),
            },
        }
        for data, media in ((first, "image/webp"), (second, "image/gif"))
    ]

    def message(*blocks):
        return claude.messages.create(
            model=SERVED_NAME,
            max_tokens=6,
            messages=[
                {"role": "user", "content": [*blocks, {"type": "text", "text": "Compare them."}]}
            ],
        )

    reply, ran = counted(api_server, lambda: message(*blocks))
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.input_tokens == ran
    assert takes_span(ran, message().usage.input_tokens, span(first) + span(second))


@pytest.mark.parametrize(
    "data,problem",
    [
        (b"\x89PNG\r\n\x1a\n" + os.urandom(200), "could not be decoded"),
        (image_bytes(40, 30, 5)[:-300], "corrupt or truncated"),
        (image_bytes(40, 30, 6, "BMP"), "BMP, an unsupported format"),
        (image_bytes(1100, 1000, 7), "too many pixels: 1100x1000"),
    ],
    ids=["garbage", "truncated", "bmp", "too-many-pixels"],
)
def test_bad_image_is_a_400_and_the_server_keeps_serving(oa, data, problem):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        chat(oa, {"type": "text", "text": "Look:"}, image_part(data))
    assert problem in caught.value.message and "image 0" in caught.value.message
    assert chat(oa, image_part(image_bytes(30, 30, 8))).choices[0].message is not None


def test_too_many_images_is_a_400(oa, claude):
    import anthropic
    import openai

    small = image_part(image_bytes(30, 30, 9))
    with pytest.raises(openai.BadRequestError, match="too many images: the request has 4"):
        chat(oa, small, small, small, small)
    block = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(b"not an image").decode(),
        },
    }
    with pytest.raises(anthropic.BadRequestError, match="could not be decoded"):
        claude.messages.create(
            model=SERVED_NAME,
            max_tokens=4,
            messages=[{"role": "user", "content": [block, {"type": "text", "text": "Hi"}]}],
        )


@pytest.mark.parametrize(
    "images,bound,value",
    [
        (
            [solid_png(1000, 1000)] * 3,
            "DEEPINFER_MAX_REQUEST_IMAGE_PIXELS",
            "too many pixels together: 3000000 up to image 2",
        ),
        (
            [image_bytes(1000, 1000, 11), image_bytes(1000, 1000, 12)],
            "DEEPINFER_MAX_REQUEST_IMAGE_BYTES",
            "too large together: ",
        ),
    ],
    ids=["pixels", "bytes"],
)
def test_a_request_over_its_image_bounds_is_a_400_and_the_server_keeps_serving(
    oa, images, bound, value
):
    """The server takes 2 megapixels and 4 MB of images per request (each image within
    its own bounds here): the refusal names the bound and the request's value."""
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        chat(oa, *map(image_part, images))
    assert bound in caught.value.message and value in caught.value.message
    assert chat(oa, image_part(image_bytes(30, 30, 8))).choices[0].message is not None


def test_image_urls_are_refused_and_never_fetched(oa, api_server):
    """The DeepSeek routes, and vLLM's own routes that render chat messages (their media
    connector is the front end's by-value one)."""
    import openai
    import requests

    fetched = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            fetched.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(image_bytes(30, 30, 10))

        def log_message(self, *args):
            pass

    listener = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=listener.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{listener.server_port}/cat.png"
    try:
        with pytest.raises(openai.BadRequestError, match="fetches no URL"):
            chat(oa, {"type": "image_url", "image_url": {"url": url}})
        with pytest.raises(openai.BadRequestError, match="fetches no URL"):
            oa.responses.create(
                model=SERVED_NAME,
                max_output_tokens=4,
                input=[{"role": "user", "content": [{"type": "input_image", "image_url": url}]}],
            )
        tokenize = requests.post(
            f"{api_server}/tokenize",
            timeout=60,
            json={
                "model": SERVED_NAME,
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
                ],
            },
        )
        assert tokenize.status_code == 400 and "fetches no URL" in tokenize.text
    finally:
        listener.shutdown()
    assert fetched == []
