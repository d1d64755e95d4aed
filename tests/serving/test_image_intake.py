"""Images checked and decoded by value before the engine: each refusal names the image
and the problem; nothing is fetched; what a request may cost (images, encoded bytes,
pixels per image and together, prompt length) is refused from the data's length and the
images' headers, before any pixel is decoded."""

import base64
import io
import json
import urllib.parse
from types import SimpleNamespace

import deepseek_recipe as dr
import numpy as np
import pytest
from PIL import Image, ImageFile
from vllm.config.multimodal import MultiModalConfig
from vllm.exceptions import VLLMValidationError
from vllm.models.deepseek_v41.common.mm_preprocess import (
    DeepseekV4VLImageProcessor,
    num_image_tokens,
)
from vllm.transformers_utils.configs.deepseek_v41 import DeepseekV41Config

from fixtures.tiny import VISION_CONFIG
from helpers import data_url, png_header
from vllm_deepinfer import envs
from vllm_deepinfer.model.deepseek_v41.image_processing import (
    DEFAULT_IMAGES_PER_PROMPT,
    V41ImageProcessingInfo,
    image_span_length,
)
from vllm_deepinfer.serving.chat_service import ApiError, ChatService
from vllm_deepinfer.serving.images import (
    ImageIntake,
    ImageRejected,
    intake_for,
    release,
    request_path,
)
from vllm_deepinfer.serving.prompts import PromptEncoder
from vllm_deepinfer.serving.protocols import CHAT, MESSAGES, RESPONSES

pytestmark = pytest.mark.unit

INTAKE = ImageIntake(
    max_images=2, max_pixels=10_000, max_request_pixels=10**9, max_request_bytes=10**9
)


def encoded(size=(20, 10), fmt="PNG", seed=0) -> bytes:
    out = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def decoded(intake: ImageIntake, sources) -> list:
    return intake.decode(intake.open(sources))


@pytest.fixture
def decodes(monkeypatch) -> list:
    """The images whose pixels get decoded (PIL's `load`), recorded instead."""
    seen = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: seen.append(self))
    return seen


def test_data_urls_base64_and_percent_encoded_and_bytes():
    png = encoded()
    sources = [
        dr.DataUrlImageSource(data_url(png)),
        dr.DataUrlImageSource("data:image/png," + urllib.parse.quote_from_bytes(png)),
    ]
    images = decoded(INTAKE, sources)
    assert [image.size for image in images] == [(20, 10), (20, 10)]
    assert images[0].media.tobytes() == Image.open(io.BytesIO(png)).convert("RGB").tobytes()
    assert images[0].original_bytes == png  # what vLLM hashes, not a copy of the pixels
    [image] = decoded(INTAKE, [dr.BytesImageSource(encoded(fmt="GIF"))])
    assert image.format == "GIF"


@pytest.mark.parametrize(
    "source,problem",
    [
        (
            dr.UrlImageSource("https://example.com/a.png", path="messages.0.content[1]"),
            "image 0 (messages[0].content[1]) is given by URL",
        ),
        (dr.DataUrlImageSource("data:image/png;base64,@@@"), "base64 data is invalid"),
        (dr.BytesImageSource(b"GIF89a" + bytes(30)), "could not be decoded"),
        (dr.BytesImageSource(encoded((60, 40))[:-300]), "png data is corrupt or truncated"),
        (dr.BytesImageSource(encoded(fmt="TIFF")), "TIFF, an unsupported format"),
        (dr.BytesImageSource(encoded((101, 100))), "too many pixels: 101x100 = 10100"),
        (dr.BytesImageSource(png_header(20000, 20000)), "too many pixels"),
    ],
)
def test_refusals_name_the_image_and_the_problem(source, problem):
    with pytest.raises(ImageRejected) as refused:
        decoded(INTAKE, [source])
    assert problem in str(refused.value)


def test_too_many_images_and_no_images_at_all():
    png = dr.BytesImageSource(encoded())
    with pytest.raises(ImageRejected, match="the request has 3, this server takes at most 2"):
        INTAKE.open([png, png, png])
    settings = envs.load({})
    text_model = intake_for(SimpleNamespace(multimodal_config=None), settings)
    with pytest.raises(ImageRejected, match="takes no images: its checkpoint has no vision"):
        text_model.open([png])
    assert text_model.open([]) == []
    off = intake_for(
        SimpleNamespace(multimodal_config=MultiModalConfig(limit_per_prompt={"image": 0})), settings
    )
    with pytest.raises(ImageRejected, match="image input is turned off"):
        off.open([png])


def test_pixels_are_checked_before_decoding(decodes):
    """A huge image is refused from its header: its pixel data is never decoded."""
    with pytest.raises(ImageRejected, match="too many pixels"):
        decoded(INTAKE, [dr.BytesImageSource(encoded((1000, 1000)))])
    assert decodes == []
    decoded(INTAKE, [dr.BytesImageSource(encoded())])
    assert len(decodes) == 1  # an image within the limit is decoded


def test_released_images_are_closed_and_let_go():
    opened = INTAKE.open(
        [dr.BytesImageSource(encoded((20, 10))), dr.BytesImageSource(encoded((30, 10), seed=1))]
    )
    images = INTAKE.decode(opened)
    assert release(opened) == 500 and opened == []
    for image in images:  # vLLM's references see closed images: no pixels are kept
        with pytest.raises(ValueError, match="closed image"):
            image.media.load()


def test_a_requests_pixels_together_are_bounded_before_decoding(decodes):
    intake = ImageIntake(
        max_images=5, max_pixels=10_000, max_request_pixels=25_000, max_request_bytes=10**9
    )
    images = [dr.BytesImageSource(encoded((100, 100), seed=i)) for i in range(3)]
    assert len(intake.open(images[:2])) == 2  # 20000 pixels
    with pytest.raises(ImageRejected) as refused:
        intake.open(images)
    message = str(refused.value)
    assert "too many pixels together: 30000 up to image 2 (100x100)" in message
    assert "more than the 25000" in message and "DEEPINFER_MAX_REQUEST_IMAGE_PIXELS" in message
    assert decodes == []


def test_a_requests_bytes_together_are_bounded_before_base64_decoding(monkeypatch):
    """The bound counts bytes after base64 decoding, exactly (padding included), and a
    data URL over it is refused from its length, its base64 never decoded."""
    pngs = [encoded((30, 30), seed=i) for i in range(3)]
    first, second = len(pngs[0]), len(pngs[0]) + len(pngs[1])
    intake = ImageIntake(
        max_images=5, max_pixels=10_000, max_request_pixels=10**9, max_request_bytes=second
    )
    sources = [dr.DataUrlImageSource(data_url(png)) for png in pngs]
    assert len(intake.open(sources[:2])) == 2  # exactly at the bound
    too_small = ImageIntake(
        max_images=5, max_pixels=10_000, max_request_pixels=10**9, max_request_bytes=second - 1
    )
    decoded_payloads = []
    real_b64decode = base64.b64decode
    monkeypatch.setattr(
        base64,
        "b64decode",
        lambda data, **kw: decoded_payloads.append(data) or real_b64decode(data, **kw),
    )
    with pytest.raises(ImageRejected) as refused:
        too_small.open(sources)
    assert len(decoded_payloads) == 1  # only the first image's base64 was decoded
    message = str(refused.value)
    assert f"too large together: {second} bytes up to image 1" in message
    assert f"more than the {second - 1}" in message
    assert "DEEPINFER_MAX_REQUEST_IMAGE_BYTES" in message
    percent = dr.DataUrlImageSource("data:image/png," + urllib.parse.quote_from_bytes(pngs[0]))
    with pytest.raises(ImageRejected, match=f"{first} bytes up to image 0"):
        ImageIntake(
            max_images=5, max_pixels=10_000, max_request_pixels=10**9, max_request_bytes=first - 1
        ).open([percent])


def test_the_settings_bound_requests_and_are_checked_together():
    defaults = envs.load({})
    assert defaults.max_request_image_pixels == 2 * defaults.max_image_pixels
    assert defaults.max_request_image_bytes == 64 * 2**20
    larger = envs.load({"DEEPINFER_MAX_IMAGE_PIXELS": str(10**9)})
    assert larger.max_request_image_pixels == 10**9  # one such image still fits
    with pytest.raises(
        envs.ConfigError,
        match="DEEPINFER_MAX_REQUEST_IMAGE_PIXELS=100 is below DEEPINFER_MAX_IMAGE_PIXELS=200",
    ):
        envs.load(
            {"DEEPINFER_MAX_IMAGE_PIXELS": "200", "DEEPINFER_MAX_REQUEST_IMAGE_PIXELS": "100"}
        )
    with pytest.raises(envs.ConfigError, match="DEEPINFER_MAX_REQUEST_IMAGE_BYTES='lots'"):
        envs.load({"DEEPINFER_MAX_REQUEST_IMAGE_BYTES": "lots"})
    intake = intake_for(SimpleNamespace(multimodal_config=MultiModalConfig()), larger)
    assert (intake.max_pixels, intake.max_request_pixels, intake.max_request_bytes) == (
        10**9,
        10**9,
        64 * 2**20,
    )


def test_images_per_prompt_default_and_the_operators_limit_wins():
    """vLLM's 999 when the operator sets nothing becomes the model's default, in vLLM's
    own checks (its routes) and the front end's; an explicit limit is kept either way."""

    def info(mm_config):
        return V41ImageProcessingInfo(SimpleNamespace(get_mm_config=lambda: mm_config))

    unset = MultiModalConfig()
    assert unset.get_limit_per_prompt("image") == 999
    info(unset).validate_num_items("image", DEFAULT_IMAGES_PER_PROMPT)
    with pytest.raises(VLLMValidationError, match=f"At most {DEFAULT_IMAGES_PER_PROMPT} "):
        info(unset).validate_num_items("image", DEFAULT_IMAGES_PER_PROMPT + 1)
    higher = MultiModalConfig(limit_per_prompt={"image": 200})
    info(higher).validate_num_items("image", 200)
    lower = MultiModalConfig(limit_per_prompt={"image": 3})
    with pytest.raises(VLLMValidationError, match="At most 3 "):
        info(lower).validate_num_items("image", 4)
    settings = envs.load({})
    assert [
        intake_for(SimpleNamespace(multimodal_config=mm), settings).max_images
        for mm in (unset, higher, lower)
    ] == [DEFAULT_IMAGES_PER_PROMPT, 200, 3]


@pytest.fixture(scope="module")
def vision_config(tiny_checkpoint) -> DeepseekV41Config:
    with open(f"{tiny_checkpoint}/config.json") as f:
        return DeepseekV41Config(**{**json.load(f), "vision_config": VISION_CONFIG})


SIZES = [
    (1, 1),
    (30, 30),
    (20, 10),
    (120, 90),
    (64, 160),
    (544, 544),
    (545, 543),
    (1000, 1),
    (1, 1000),
    (4000, 20),
    (20, 4000),
    (1800, 1400),
    (777, 333),
]


@pytest.mark.parametrize("config", ["tiny", "release"])
def test_span_length_from_the_size_equals_upstreams_preprocessing(vision_config, config):
    """The span known from the header is the one upstream's preprocessing gives the
    decoded image: the tiny checkpoint's vision config (aspect-ratio limit 4) and the
    release's defaults (1024 tokens, 544x544 minimum)."""
    config = vision_config if config == "tiny" else DeepseekV41Config()
    for size in SIZES:
        *_, rows, cols = DeepseekV4VLImageProcessor(config)(Image.new("RGB", size))
        assert image_span_length(config, size) == num_image_tokens(rows, cols), size


def test_request_paths_read_alike_on_every_route():
    assert request_path(".messages[0]") == "messages[0]"  # the recipe's Chat paths
    assert request_path("messages.0.content[1]") == "messages[0].content[1]"
    assert request_path("messages.2.content.0.tool_result") == "messages[2].content[0].tool_result"
    assert request_path("input[3]") == "input[3]"


@pytest.fixture(scope="module")
def service(tiny_checkpoint, vision_config):
    """The service's request preparation for a vision model taking 2 images of at most
    10000 pixels, 15000 together, in a 1024-token context."""
    model_config = SimpleNamespace(
        multimodal_config=MultiModalConfig(limit_per_prompt={"image": 2}),
        hf_config=vision_config,
        get_vocab_size=lambda: 129_280,
    )
    with envs.overridden(
        DEEPINFER_MAX_IMAGE_PIXELS="10000", DEEPINFER_MAX_REQUEST_IMAGE_PIXELS="15000"
    ):
        return ChatService(
            SimpleNamespace(model_config=model_config),
            PromptEncoder(tiny_checkpoint),
            ["tiny"],
            1024,
        )


def prepare(service, protocol, body):
    return service.prepare(protocol, json.dumps(body).encode(), "application/json")


def chat_image(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def test_chat_paths_name_the_message_without_a_leading_dot(service):
    body = {
        "model": "tiny",
        "messages": [
            {"role": "user", "content": "first"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "see"}, chat_image(encoded((200, 100)))],
            },
        ],
    }
    with pytest.raises(ApiError) as refused:
        prepare(service, CHAT, body)
    assert refused.value.message.startswith("image 0 (messages[1]) has too many pixels")


def test_a_prompt_too_long_is_refused_before_any_image_is_decoded(service, decodes):
    """The span of each image comes from its header: the request is refused for its
    length with no pixel decoded; one that fits is not decoded in preparation either
    (the engine input decodes it, one request at a time)."""
    image = chat_image(encoded((80, 80)))
    fits = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, image, image]}],
    }
    prepared = prepare(service, CHAT, fits)
    assert prepared.prompt_length == len(prepared.prompt_ids) + 2 * (
        image_span_length(service.hf_config, (80, 80)) - 1
    )
    long = {
        "model": "tiny",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "word " * (1024 - prepared.prompt_length + 10)},
                    image,
                    image,
                ],
            }
        ],
    }
    with pytest.raises(ApiError, match="maximum context length is 1024"):
        prepare(service, CHAT, long)
    assert decodes == []


def messages_image(data: bytes) -> dict:
    return {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(data).decode(),
        },
    }


@pytest.mark.parametrize(
    "protocol,body,where",
    [
        (
            CHAT,
            {
                "messages": [
                    {"role": "system", "content": [chat_image(encoded())]},
                    {"role": "user", "content": "hi"},
                ]
            },
            "messages[0]",
        ),
        (
            CHAT,
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "developer", "content": [chat_image(encoded())]},
                    {"role": "user", "content": "hi"},
                ]
            },
            "messages[1]",
        ),
        (
            RESPONSES,
            {
                "input": [
                    {
                        "role": "system",
                        "content": [{"type": "input_image", "image_url": data_url(encoded())}],
                    },
                    {"role": "user", "content": "hi"},
                ]
            },
            "input[0]",
        ),
        (
            MESSAGES,
            {
                "max_tokens": 8,
                "system": [{"type": "text", "text": "look"}, messages_image(encoded())],
                "messages": [{"role": "user", "content": "hi"}],
            },
            "system[1]",
        ),
    ],
    ids=["chat-system", "chat-developer", "responses-system", "messages-system"],
)
def test_images_in_system_messages_are_refused_alike(service, protocol, body, where):
    with pytest.raises(ApiError) as refused:
        prepare(service, protocol, {"model": "tiny", **body})
    assert refused.value.status == 400
    assert refused.value.message == (
        f"{where}: images are not accepted in system messages; send them in a user message"
    )
    user = {
        CHAT: {"messages": [{"role": "user", "content": [chat_image(encoded())]}]},
        RESPONSES: {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": data_url(encoded())}],
                }
            ]
        },
        MESSAGES: {
            "max_tokens": 8,
            "messages": [{"role": "user", "content": [messages_image(encoded())]}],
        },
    }[protocol]
    assert len(prepare(service, protocol, {"model": "tiny", **user}).images) == 1
