"""Images checked and decoded by value before the engine: each refusal names the image
and the problem; nothing is fetched; an oversized image is refused from its header."""
import base64
import io
import struct
import urllib.parse
import zlib
from types import SimpleNamespace

import deepseek_recipe as dr
import numpy as np
import pytest
from PIL import Image, ImageFile

from vllm_deepinfer.serving.images import ImageIntake, ImageRejected, intake_for

pytestmark = pytest.mark.unit

INTAKE = ImageIntake(max_images=2, max_pixels=10_000)


def encoded(size=(20, 10), fmt="PNG") -> bytes:
    out = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that only claims its size (a decompression bomb's header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height,
                                                                8, 2, 0, 0, 0))
            + chunk(b"IEND", b""))


def test_data_urls_base64_and_percent_encoded_and_bytes():
    png = encoded()
    sources = [dr.DataUrlImageSource("data:image/png;base64," + base64.b64encode(png).decode()),
               dr.DataUrlImageSource("data:image/png," + urllib.parse.quote_from_bytes(png))]
    images = INTAKE.decode(sources)
    assert [image.size for image in images] == [(20, 10), (20, 10)]
    assert images[0].tobytes() == Image.open(io.BytesIO(png)).convert("RGB").tobytes()
    [image] = INTAKE.decode([dr.BytesImageSource(encoded(fmt="GIF"))])
    assert image.format == "GIF"


@pytest.mark.parametrize("source,problem", [
    (dr.UrlImageSource("https://example.com/a.png", path="messages.0.content[1]"),
     "image 0 (messages.0.content[1]) is given by URL"),
    (dr.DataUrlImageSource("data:image/png;base64,@@@"), "base64 data is invalid"),
    (dr.BytesImageSource(b"GIF89a" + bytes(30)), "could not be decoded"),
    (dr.BytesImageSource(encoded((60, 40))[:-300]), "png data is corrupt or truncated"),
    (dr.BytesImageSource(encoded(fmt="TIFF")), "TIFF, an unsupported format"),
    (dr.BytesImageSource(encoded((101, 100))), "too many pixels: 101x100 = 10100"),
    (dr.BytesImageSource(png_header(20000, 20000)), "too many pixels"),
])
def test_refusals_name_the_image_and_the_problem(source, problem):
    with pytest.raises(ImageRejected, match=problem.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        INTAKE.decode([source])


def test_too_many_images_and_no_images_at_all():
    png = dr.BytesImageSource(encoded())
    with pytest.raises(ImageRejected, match="the request has 3, this server takes at most 2"):
        INTAKE.decode([png, png, png])
    text_model = intake_for(SimpleNamespace(multimodal_config=None), 10)
    with pytest.raises(ImageRejected, match="takes no images: its checkpoint has no vision"):
        text_model.decode([png])
    assert text_model.decode([]) == []
    off = intake_for(SimpleNamespace(multimodal_config=SimpleNamespace(
        get_limit_per_prompt=lambda modality: 0)), 10)
    with pytest.raises(ImageRejected, match="image input is turned off"):
        off.decode([png])


def test_pixels_are_checked_before_decoding(monkeypatch):
    """A huge image is refused from its header: its pixel data is never decoded."""
    huge = dr.BytesImageSource(encoded((1000, 1000)))
    decoded = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self))
    with pytest.raises(ImageRejected, match="too many pixels"):
        INTAKE.decode([huge])
    assert decoded == []
    INTAKE.decode([dr.BytesImageSource(encoded())])
    assert len(decoded) == 1  # an image within the limit is decoded
