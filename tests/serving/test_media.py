"""serving/media: vLLM's own routes load media only from data URLs, base64 or
percent-encoded (RFC 2397); any other URL is vLLM's 400, never fetched."""

import base64
import io

import pytest
from PIL import Image

from vllm_deepinfer.serving.media import ByValueMediaConnector, by_value

pytestmark = pytest.mark.unit


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (3, 2), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


def test_a_percent_encoded_data_url_loads_as_its_base64_form():
    from vllm.multimodal.media import ImageMediaIO

    data = png()
    percent = "data:image/png," + "".join(f"%{b:02X}" for b in data)
    assert by_value(percent) == "data:image/png;base64," + base64.b64encode(data).decode()
    image = ByValueMediaConnector().load_from_url(percent, ImageMediaIO())
    assert image.size == (3, 2) and image.getpixel((0, 0)) == (200, 10, 10)


@pytest.mark.parametrize(
    "url",
    ["data:image/png;base64,iVBORw==", "DATA:image/png;BASE64,AAAA", "data:image/png"],
)
def test_base64_and_malformed_data_urls_reach_vllms_connector_unchanged(url):
    assert by_value(url) == url


def test_plain_text_data_urls_keep_their_parameters():
    assert by_value("data:text/plain;charset=utf-8,a%20b") == (
        "data:text/plain;charset=utf-8;base64," + base64.b64encode(b"a b").decode()
    )


@pytest.mark.parametrize("url", ["http://127.0.0.1/cat.png", "file:///etc/passwd", "cat.png"])
def test_other_urls_are_a_value_error_naming_why(url):
    with pytest.raises(ValueError, match="fetches no URL"):
        by_value(url)


def test_a_percent_encoded_url_that_is_no_image_is_a_value_error():
    """vLLM's 400, where vLLM's own connector answered the form itself with a 501."""
    from vllm.multimodal.media import ImageMediaIO

    with pytest.raises(ValueError, match="Failed to load image"):
        ByValueMediaConnector().load_from_url("data:image/png,%89PNG", ImageMediaIO())
