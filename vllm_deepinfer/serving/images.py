"""Images a request sends, checked and decoded before the engine sees them.

deepseek-recipe renders each image of a Chat Completions (`image_url`), Responses
(`input_image`) or Messages (`image` block) request as one image placeholder and hands
its source over; here each source becomes a PIL image, or the request gets a 400 naming
the image and the problem. Images come only by value (a data URL or base64 data): no URL
is ever fetched.

What a request may cost is bounded before any pixel is decoded: the number of images,
their encoded bytes together, each image's pixels and all images' pixels together, all
read from the data's length and the images' headers (`open`); the caller checks the
prompt length from the header sizes too. Only then are the images decoded, one at a time
(`decode`), and once vLLM's multimodal processing has made its patches of them they are
let go (`release`). The release's own preprocessing (resizing to the token budget,
patching) runs in vLLM's multimodal processor.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import io
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError
from vllm.multimodal.media.base import MediaWithBytes

from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.model.deepseek_v41.image_processing import images_per_prompt

logger = init_logger(__name__)

FORMATS = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}
"""The formats DeepSeek's API takes (deepseek-recipe's list)."""

TRIM_AFTER_PIXELS = 4_000_000
"""Decoded pixels after which the freed heap is handed back to the system (`trim_heap`),
of one request or of several in a row: the allocators keep freed memory of many-megabyte
images, so the API server's RSS stayed ~570 MiB up after a four-image request on glibc,
and ~450 MiB after a three-image one on tcmalloc, until they were asked to return it; a
burst of 2-megapixel requests, each under this, left it ~90 MiB up on tcmalloc when only
a single request's pixels counted."""


class ImageRejected(ValueError):
    """An image the service refuses; the message names it and says why."""


def request_path(path: str) -> str:
    """A request location as the recipe reports it, written one way on every route:
    `messages[1].content[2]` (the recipe writes Chat's `.messages[1]` and Messages'
    `messages.1.content[2]`)."""
    return re.sub(r"\.(\d+)(?=[.\[]|$)", r"[\1]", path).lstrip(".")


def _system_image_refusal(where: str) -> str:
    """One refusal on every route: Anthropic's Messages `system` takes text only, so the
    recipe cannot carry an image there, and Chat and Responses refuse it alike."""
    return f"{where}: images are not accepted in system messages; send them in a user message"


def refuse_system_images(body: dict) -> None:
    """Messages: an image block in `system`, refused by name (the recipe's parser would
    answer an unknown variant)."""
    system = body.get("system")
    for i, block in enumerate(system if isinstance(system, list) else ()):
        if isinstance(block, dict) and block.get("type") == "image":
            raise ImageRejected(_system_image_refusal(f"system[{i}]"))


def refuse_system_message_images(conversation) -> None:
    """Chat and Responses: the recipe takes images in system (and developer) messages;
    they are refused as on Messages."""
    for message in conversation.messages:
        if message.role == "system" and message.image_sources:
            path = message.image_sources[0].path
            raise ImageRejected(
                _system_image_refusal(request_path(path) if path else "a system message")
            )


@dataclass
class OpenedImage:
    """An image whose header has been read; its pixels are not decoded yet."""

    where: str
    data: bytes
    image: Image.Image

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


@dataclass(frozen=True)
class ImageIntake:
    max_images: int
    """Per request: vLLM's `--limit-mm-per-prompt` for images, or the model's default
    (0: images are off)."""
    max_pixels: int
    """Per image, width x height (DEEPINFER_MAX_IMAGE_PIXELS)."""
    max_request_pixels: int
    """All images of a request together (DEEPINFER_MAX_REQUEST_IMAGE_PIXELS)."""
    max_request_bytes: int
    """Encoded bytes of all images of a request, base64-decoded
    (DEEPINFER_MAX_REQUEST_IMAGE_BYTES)."""
    why_none: str = ""
    """Why this model takes no images at all, when it takes none."""

    def open(self, sources) -> list[OpenedImage]:
        """The recipe's image sources, in prompt order, with their headers read and every
        bound checked; no pixel is decoded."""
        if not sources:
            return []
        if self.why_none:
            raise ImageRejected(f"this model takes no images: {self.why_none}")
        if len(sources) > self.max_images:
            raise ImageRejected(
                f"too many images: the request has {len(sources)}, this "
                f"server takes at most {self.max_images} per request "
                "(--limit-mm-per-prompt)"
            )
        opened, total_bytes, total_pixels = [], 0, 0
        for number, source in enumerate(sources):
            where = f"image {number}" + (f" ({request_path(source.path)})" if source.path else "")
            size, read = _encoded(source, where)
            if size is not None:  # known before the base64 data is decoded
                self._check_bytes(total_bytes + size, where)
            data = read()
            total_bytes += len(data)
            self._check_bytes(total_bytes, where)
            item = OpenedImage(where, data, _open(data, where, self.max_pixels))
            width, height = item.size
            if width * height > self.max_pixels:
                raise ImageRejected(
                    f"{where} has too many pixels: {width}x{height} = "
                    f"{width * height}, more than the {self.max_pixels} "
                    "this server takes (DEEPINFER_MAX_IMAGE_PIXELS)"
                )
            total_pixels += width * height
            if total_pixels > self.max_request_pixels:
                raise ImageRejected(
                    f"the request's images have too many pixels together: {total_pixels} "
                    f"up to {where} ({width}x{height}), more than the "
                    f"{self.max_request_pixels} this server takes per request "
                    "(DEEPINFER_MAX_REQUEST_IMAGE_PIXELS)"
                )
            opened.append(item)
        return opened

    def _check_bytes(self, total: int, where: str) -> None:
        if total > self.max_request_bytes:
            raise ImageRejected(
                f"the request's images are too large together: {total} "
                f"bytes up to {where}, more than the "
                f"{self.max_request_bytes} this server takes per request "
                "(DEEPINFER_MAX_REQUEST_IMAGE_BYTES)"
            )

    @staticmethod
    def decode(opened: list[OpenedImage]) -> list[MediaWithBytes]:
        """The images decoded, one at a time, each with its encoded bytes: vLLM hashes
        those for its caches instead of a copy of the pixels. On a corrupt image, those
        decoded already are let go (`release`)."""
        for item in opened:
            try:
                item.image.load()
            except (OSError, ValueError, SyntaxError):
                where, kind = item.where, FORMATS[item.image.format]
                if release(opened) >= TRIM_AFTER_PIXELS:
                    trim_heap()
                raise ImageRejected(
                    f"{where} could not be decoded: the {kind} data is corrupt or truncated"
                ) from None
        return [MediaWithBytes(item.image, item.data) for item in opened]


def release(opened: list[OpenedImage]) -> int:
    """Frees a request's images, decoded or not (vLLM needs only its patches of them), and
    empties the list. Returns the pixels released: once TRIM_AFTER_PIXELS have been, the
    caller hands the freed heap back with `trim_heap` (off the event loop: ~0.1 s per GiB)."""
    pixels = sum(item.image.width * item.image.height for item in opened)
    for item in opened:
        item.image.close()
    opened.clear()
    return pixels


def trim_heap() -> None:
    """Free memory back to the system: tcmalloc's `ReleaseFreeMemory` where the process
    runs on it (`deepinfer serve` preloads it, preload.py), else glibc's
    `malloc_trim(0)` (every arena); nothing where neither is there."""
    if _RELEASE_FREE_MEMORY is not None:
        _RELEASE_FREE_MEMORY()


def _release_free_memory():
    process = ctypes.CDLL(None)
    for name, arguments in (("MallocExtension_ReleaseFreeMemory", ()), ("malloc_trim", (0,))):
        function = getattr(process, name, None)
        if function is not None:
            return lambda: function(*arguments)
    logger.debug(
        "neither tcmalloc nor glibc's malloc_trim here: freed image memory stays with the allocator"
    )
    return None


_RELEASE_FREE_MEMORY = _release_free_memory()
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 1 << 20


def map_large_allocations() -> None:
    """On glibc's allocator (the API server without tcmalloc), blocks from MMAP_THRESHOLD
    up get mappings of their own, which go back to the system when freed. glibc otherwise
    raises its threshold as large blocks are freed (up to 32 MiB) and serves request bodies
    and decoded images from its heap: a burst of image requests then left the API server's
    RSS 40-110 MiB higher each time, fragmentation `malloc_trim` could not undo."""
    process = ctypes.CDLL(None)
    if getattr(process, "MallocExtension_ReleaseFreeMemory", None) is not None:
        return  # tcmalloc returns what trim_heap asks
    mallopt = getattr(process, "mallopt", None)
    if mallopt is not None and not mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        logger.warning(
            "glibc refused mallopt(M_MMAP_THRESHOLD): freed image memory may "
            "stay with the allocator"
        )


def _open(data: bytes, where: str, max_pixels: int) -> Image.Image:
    """The image with only its header read (PIL decodes pixels on `load`)."""
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:  # PIL's own ceiling, far above ours
        raise ImageRejected(
            f"{where} has too many pixels ({e}), more than the {max_pixels} "
            "this server takes (DEEPINFER_MAX_IMAGE_PIXELS)"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise ImageRejected(
            f"{where} could not be decoded: the data is corrupt or not "
            f"an image of a supported format "
            f"({', '.join(FORMATS.values())})"
        ) from None
    if image.format not in FORMATS:
        raise ImageRejected(
            f"{where} is {image.format}, an unsupported format; send {', '.join(FORMATS.values())}"
        )
    return image


def _encoded(source, where: str) -> tuple[int | None, Callable[[], bytes]]:
    """The image's size in bytes where it is known before decoding (bytes, and a base64
    data URL from its length), and how to get the bytes; the source's data (copied out
    of the recipe on each access) is read once."""
    if source.kind == "bytes":
        data = source.data
        return len(data), lambda: data
    if source.kind != "data_url":
        raise ImageRejected(
            f"{where} is given by URL; this server takes images only by "
            "value (a base64 data URL or base64 data) and fetches no URL"
        )
    header, comma, payload = source.data_url.partition(",")
    if not comma or not header.lower().startswith("data:"):
        raise ImageRejected(f"{where} is not a valid data URL (data:<type>;base64,<data>)")
    if not header.lower().endswith(";base64"):
        return None, lambda: urllib.parse.unquote_to_bytes(payload)

    def decoded() -> bytes:
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageRejected(f"{where}: the data URL's base64 data is invalid") from None

    size = len(payload) // 4 * 3 - payload[-2:].count("=") if len(payload) % 4 == 0 else None
    return size, decoded


def intake_for(model_config, settings) -> ImageIntake:
    """What the served model takes: images only where vLLM built it multimodal, within
    the settings' bounds (envs.DeepInferSettings)."""
    bounds = dict(
        max_pixels=settings.max_image_pixels,
        max_request_pixels=settings.max_request_image_pixels,
        max_request_bytes=settings.max_request_image_bytes,
    )
    mm = getattr(model_config, "multimodal_config", None)
    if mm is None:
        return ImageIntake(0, **bounds, why_none="its checkpoint has no vision tower")
    limit = images_per_prompt(mm)
    if limit == 0:
        return ImageIntake(
            0, **bounds, why_none="image input is turned off (--limit-mm-per-prompt image=0)"
        )
    return ImageIntake(limit, **bounds)
