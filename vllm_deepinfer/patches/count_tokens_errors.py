"""A client error on vLLM's `/v1/messages/count_tokens` is answered without a traceback in
the server's log.

Why: vLLM's count_tokens route catches every exception of its handler and logs it with
`logger.exception` before answering it: a prompt over the context length, messages the
V4.1 encoder cannot render, any body vLLM refuses with a 400 leaves a traceback in the
log as if the server had failed. vLLM's other routes get such refusals back from their
handlers as error responses and log no traceback.

How: applied by the front end (in the API server, the one process that serves routes),
`AnthropicServingMessages.count_tokens` is wrapped: an exception vLLM answers with a 4xx
(by vLLM's own `create_error_response` mapping) is returned as that error response, which
the route translates to the same Anthropic error body and status it answered before; an
exception vLLM answers with a 5xx goes on to the route's log and answer as before.

Upstream symbols: vllm.entrypoints.anthropic.serving.AnthropicServingMessages.count_tokens,
vllm.entrypoints.anthropic.api_router.count_tokens (read for its `logger.exception`);
written against vLLM 0.32; to report upstream (a draft is in docs/patches.md).

Remove when: vLLM's count_tokens route logs client errors without a traceback (its source
then has no `logger.exception`, and the patch reports `not needed`)."""

from __future__ import annotations

import functools
import sys

from vllm_deepinfer.patches.base import (
    PatchUnavailable,
    installed,
    left_to_vllm,
    source_of,
    upstream_method,
    upstream_symbols,
)

UPSTREAM = (
    "vllm.entrypoints.anthropic.serving.AnthropicServingMessages.count_tokens, "
    "vllm.entrypoints.anthropic.api_router.count_tokens"
)
_MARK = "_deepinfer_count_tokens_errors"


def _upstream():
    """(AnthropicServingMessages, vLLM's create_error_response, the route's source)."""
    try:
        from vllm.entrypoints.anthropic import api_router, serving
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )
    except ImportError as exc:
        raise PatchUnavailable(f"vLLM's Anthropic routes cannot be imported ({exc})") from exc
    cls, route = upstream_symbols(
        (serving, "AnthropicServingMessages"), (api_router, "count_tokens")
    )
    upstream_method(cls, "count_tokens", "AnthropicServingMessages.count_tokens")
    return cls, create_error_response, source_of(route, "api_router.count_tokens")


def apply() -> bool:
    """Idempotent; True once installed, False where vLLM's route logs no traceback."""
    cls, create_error_response, route_source = _upstream()
    if "logger.exception" not in route_source:
        return left_to_vllm(sys.modules[__name__], "logs count_tokens' errors without a traceback")
    original = cls.count_tokens
    if installed(original, _MARK):
        return True

    @functools.wraps(original)
    async def count_tokens(self, *args, **kwargs):
        try:
            return await original(self, *args, **kwargs)
        except Exception as exc:
            response = create_error_response(exc)
            if response.error.code >= 500:
                raise
            return response

    setattr(count_tokens, _MARK, True)
    cls.count_tokens = count_tokens
    return True
