"""Prefill/decode disaggregation over the context cache.

A P/D router (vllm-router's vLLM mode) sends the prompt to the prefill instance with
`kv_transfer_params: {"do_remote_decode": true}` and `max_tokens: 1`, then sends the
same request to the decode instance with whatever `kv_transfer_params` the prefill's
response carried. Both instances keep their global KV in one shared context-cache
directory. The prefill announces there how many prompt tokens of global KV it is
writing, under which layout; the decode instance waits, boundedly, for those blocks to
reach the directory before it decides what is a hit. The prefill's writes are
asynchronous (its last blocks are stored at the step after the request ends, and the
response does not wait for them), so without the wait a decode request that arrives
first would recompute the whole prompt. Past the bound what is missing is recomputed,
and the wait is logged and counted.

What the decode instance loads is global KV only; bounded replay recomputes the last
`DEEPINFER_YOCO_PREFILL_KEEP_TOKENS` tokens of window state there, as for any hit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)

ANNOUNCEMENT = "deepinfer_global_kv"
"""The key of the prefill's announcement in `kv_transfer_params`."""


def wants_announcement(kv_transfer_params: dict[str, Any] | None) -> bool:
    """Whether a request is the prefill half of a P/D pair (the router asks for the KV to
    be handed to a decode instance)."""
    return bool(isinstance(kv_transfer_params, dict) and kv_transfer_params.get("do_remote_decode"))


def announcement(layout: bytes, prompt_tokens: int) -> dict[str, Any]:
    """The prefill response's `kv_transfer_params`: the layout its blocks are written
    under and the prompt tokens they cover (whole blocks up to that count)."""
    return {ANNOUNCEMENT: {"layout": layout.hex(), "tokens": int(prompt_tokens)}}


@dataclass
class AwaitedBlocks:
    """A decode request's wait for the blocks its prefill announced."""

    tokens: int
    deadline: float
    started: float
    waited: bool = False
    timed_out: bool = False


def awaited_blocks(
    kv_transfer_params: dict[str, Any] | None,
    layout: bytes,
    wait_seconds: float,
    now: float | None = None,
) -> AwaitedBlocks | None:
    """What a decode request waits for: None without an announcement, with waiting off,
    or for blocks of another layout (another model or settings: they never arrive under
    this layout, so waiting would only delay the recomputation; logged)."""
    if not isinstance(kv_transfer_params, dict) or wait_seconds <= 0:
        return None
    announced = kv_transfer_params.get(ANNOUNCEMENT)
    if announced is None:
        return None
    if (
        not isinstance(announced, dict)
        or not isinstance(announced.get("tokens"), int)
        or isinstance(announced.get("tokens"), bool)
        or announced["tokens"] < 0
        or not isinstance(announced.get("layout"), str)
    ):
        logger.warning(
            "Ignoring a malformed %s in kv_transfer_params (%.200r); the prompt "
            "is looked up without waiting",
            ANNOUNCEMENT,
            announced,
        )
        return None
    if announced["layout"] != layout.hex():
        logger.warning(
            "A prefill instance announced global KV of context-cache layout %s; "
            "this instance uses %s (another model, precision, block size or "
            "plugin version), so the prompt is recomputed here",
            announced["layout"],
            layout.hex(),
        )
        return None
    now = time.monotonic() if now is None else now
    return AwaitedBlocks(tokens=announced["tokens"], deadline=now + wait_seconds, started=now)
