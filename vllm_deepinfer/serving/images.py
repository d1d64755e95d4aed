"""Images a request sends, checked and decoded before the engine sees them.

deepseek-recipe renders each image of a Chat Completions (`image_url`), Responses
(`input_image`) or Messages (`image` block) request as one image placeholder and hands
its source over; here each source becomes a PIL image, or the request gets a 400 naming
the image and the problem. Images come only by value (a data URL or base64 data): no URL
is ever fetched. Pixel counts are read from the header, so an oversized image is refused
before it is decoded. The release's own preprocessing (resizing to the token budget,
patching) runs later, in the engine's multimodal processor; `span_length` asks it how many
prompt tokens an image takes.
"""
from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

FORMATS = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}
"""The formats DeepSeek's API takes (deepseek-recipe's list)."""


class ImageRejected(ValueError):
    """An image the service refuses; the message names it and says why."""


@dataclass(frozen=True)
class ImageIntake:
    max_images: int
    """Per request: vLLM's `--limit-mm-per-prompt` for images (0: images are off)."""
    max_pixels: int
    """Per image, width x height (DEEPINFER_MAX_IMAGE_PIXELS)."""
    why_none: str = ""
    """Why this model takes no images at all, when it takes none."""

    def decode(self, sources) -> list[Image.Image]:
        """PIL images of the recipe's image sources, in prompt order."""
        if not sources:
            return []
        if self.why_none:
            raise ImageRejected(f"this model takes no images: {self.why_none}")
        if len(sources) > self.max_images:
            raise ImageRejected(f"too many images: the request has {len(sources)}, this "
                                f"server takes at most {self.max_images} per request "
                                "(--limit-mm-per-prompt)")
        return [self._decode_one(source, number) for number, source in enumerate(sources)]

    def _decode_one(self, source, number: int) -> Image.Image:
        where = f"image {number}" + (f" ({source.path})" if source.path else "")
        data = _bytes_of(source, where)
        try:
            image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:  # PIL's own ceiling, far above ours
            raise ImageRejected(f"{where} has too many pixels ({e})") from None
        except (UnidentifiedImageError, OSError, ValueError):
            raise ImageRejected(f"{where} could not be decoded: the data is corrupt or not "
                                f"an image of a supported format "
                                f"({', '.join(FORMATS.values())})") from None
        if image.format not in FORMATS:
            raise ImageRejected(f"{where} is {image.format}, an unsupported format; send "
                                f"{', '.join(FORMATS.values())}")
        width, height = image.size
        if width * height > self.max_pixels:
            raise ImageRejected(f"{where} has too many pixels: {width}x{height} = "
                                f"{width * height}, more than the {self.max_pixels} this "
                                "server takes (DEEPINFER_MAX_IMAGE_PIXELS)")
        try:
            image.load()
        except (OSError, ValueError, SyntaxError):
            raise ImageRejected(f"{where} could not be decoded: the {FORMATS[image.format]} "
                                "data is corrupt or truncated") from None
        return image


def _bytes_of(source, where: str) -> bytes:
    if source.kind == "bytes":
        return source.data
    if source.kind != "data_url":
        raise ImageRejected(f"{where} is given by URL; this server takes images only by "
                            "value (a base64 data URL or base64 data) and fetches no URL")
    header, comma, payload = source.data_url.partition(",")
    if not comma or not header.lower().startswith("data:"):
        raise ImageRejected(f"{where} is not a valid data URL (data:<type>;base64,<data>)")
    if header.lower().endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageRejected(f"{where}: the data URL's base64 data is invalid") from None
    return urllib.parse.unquote_to_bytes(payload)


def intake_for(model_config, max_pixels: int) -> ImageIntake:
    """What the served model takes: images only where vLLM built it multimodal."""
    mm = getattr(model_config, "multimodal_config", None)
    if mm is None:
        return ImageIntake(0, max_pixels, "its checkpoint has no vision tower")
    limit = mm.get_limit_per_prompt("image")
    if limit == 0:
        return ImageIntake(0, max_pixels, "image input is turned off "
                                          "(--limit-mm-per-prompt image=0)")
    return ImageIntake(limit, max_pixels)
