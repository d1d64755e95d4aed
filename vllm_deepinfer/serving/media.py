"""Media by value only, for every route of the server, not just the DeepSeek API ones.

vLLM's own routes that render chat messages (`/tokenize`, `/invocations`, batch chat, ...)
load `image_url`s through its media connector, which downloads http(s) URLs and reads
file URLs. The front end registers this connector in vLLM's `MEDIA_CONNECTOR_REGISTRY`
(the extension point `VLLM_MEDIA_CONNECTOR` chooses from) and makes it the default: data
URLs load, any other URL is refused, never fetched.

A data URL's data may be percent-encoded rather than base64 (RFC 2397), as the DeepSeek
API routes take it; vLLM's connector answers that form with a 501 (NotImplementedError),
so this one hands it on re-encoded in base64.
"""

from __future__ import annotations

import base64
import os
import urllib.parse

from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY, MediaConnector

from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)

CONNECTOR_NAME = "deepinfer_by_value"
REFUSAL = "this server takes media only by value (a data URL) and fetches no URL"


def by_value(url: str) -> str:
    """`url` as a base64 data URL vLLM's connector loads; ValueError (vLLM's 400) for
    any URL that is not a data URL."""
    if url[:5].lower() != "data:":
        raise ValueError(REFUSAL)
    header, comma, data = url.partition(",")
    if not comma or header.lower().endswith(";base64"):
        return url  # vLLM's connector loads it, or names what is wrong
    encoded = base64.b64encode(urllib.parse.unquote_to_bytes(data)).decode()
    return f"{header};base64,{encoded}"


@MEDIA_CONNECTOR_REGISTRY.register(CONNECTOR_NAME)
class ByValueMediaConnector(MediaConnector):
    def load_from_url(self, url: str, media_io, *, fetch_timeout: int | None = None):
        return super().load_from_url(by_value(url), media_io, fetch_timeout=fetch_timeout)

    async def load_from_url_async(self, url: str, media_io, *, fetch_timeout: int | None = None):
        return await super().load_from_url_async(
            by_value(url), media_io, fetch_timeout=fetch_timeout
        )


def use_by_value_media() -> None:
    """Makes the connector vLLM's default in this (the API server's) process, unless the
    operator chose one with VLLM_MEDIA_CONNECTOR."""
    import vllm.envs

    chosen = os.environ.setdefault("VLLM_MEDIA_CONNECTOR", CONNECTOR_NAME)
    if chosen != CONNECTOR_NAME:
        logger.warning(
            "VLLM_MEDIA_CONNECTOR=%s: vLLM's own routes load media URLs through "
            "it (the DeepSeek API routes still take images only by value)",
            chosen,
        )
    elif vllm.envs.VLLM_MEDIA_CONNECTOR != CONNECTOR_NAME:
        logger.warning(
            "vLLM read its settings before the front end started: its own routes "
            "may still fetch media URLs"
        )
