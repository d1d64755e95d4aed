"""Messages vLLM's DeepSeek V4.1 prompt encoder cannot render are a 400, not a 500.

Why: vLLM's V4.1 tokenizer renders a request's messages with `encode_messages` from its
`deepseek_v41_encoding`, which checks them with `assert` and `NotImplementedError`: a
developer message with empty content is an AssertionError, an unknown `task` too; a role
it has no template for is a NotImplementedError. Those messages come from the client, but
vLLM's handlers answer an AssertionError with a 500 (and a traceback in the log) and a
NotImplementedError with a 501, on every route that renders messages through vLLM's
renderer: `/tokenize`, `/invocations`, `/v1/chat/completions/render`, the batch route
(the plugin's own chat routes render through deepseek-recipe and refuse such messages).

How: `vllm.tokenizers.deepseek_v41.encode_messages` (the name the tokenizer calls) is
wrapped: any error the encoder raises on the messages it is given (AssertionError,
NotImplementedError, KeyError, IndexError, TypeError, AttributeError) becomes vLLM's
`VLLMValidationError` for `messages`, its 400 in its error shape, with the encoder's own
reason.

Upstream symbols: vllm.tokenizers.deepseek_v41.encode_messages (from
vllm.tokenizers.deepseek_v41_encoding), probed with a developer message of empty content.
Written against vLLM 0.32; to report upstream (a draft is in docs/patches.md: the sandbox
has no network).

Remove when: the encoder raises ValueError (or vLLM's validation error) for messages it
cannot render (the probe then finds no crash, and the patch reports `not needed`)."""

from __future__ import annotations

import functools
import sys

from vllm_deepinfer.patches.base import PatchUnavailable, crashes, installed, left_to_vllm

UPSTREAM = "vllm.tokenizers.deepseek_v41.encode_messages"
_MARK = "_deepinfer_deepseek_v41_messages"
_CLIENT_ERRORS = (
    AssertionError,
    NotImplementedError,
    KeyError,
    IndexError,
    TypeError,
    AttributeError,
)
_PROBE = [{"role": "developer", "content": ""}]


def check_upstream():
    """(the tokenizer module, VLLMValidationError)."""
    try:
        from vllm.exceptions import VLLMValidationError
        from vllm.tokenizers import deepseek_v41
    except ImportError as exc:
        raise PatchUnavailable(f"vllm.tokenizers.deepseek_v41 cannot be imported ({exc})") from exc
    if not callable(getattr(deepseek_v41, "encode_messages", None)):
        raise PatchUnavailable(f"{UPSTREAM} is missing")
    return deepseek_v41, VLLMValidationError


def _crashes(encode) -> bool:
    """Whether `encode` fails on _PROBE with an error vLLM answers with a 5xx."""
    return crashes(lambda: encode(_PROBE, thinking_mode="chat"), _CLIENT_ERRORS)


def apply() -> bool:
    """Idempotent; True once installed, False where the encoder refuses the probe itself."""
    module, refusal = check_upstream()
    original = module.encode_messages
    if installed(original, _MARK):
        return True
    if not _crashes(original):
        return left_to_vllm(
            sys.modules[__name__], "refuses messages it cannot render with a client error"
        )

    @functools.wraps(original)
    def encode_messages(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except _CLIENT_ERRORS as exc:
            reason = str(exc) or type(exc).__name__
            raise refusal(
                f"messages: DeepSeek V4.1 cannot render them: {reason}", parameter="messages"
            ) from exc

    setattr(encode_messages, _MARK, True)
    module.encode_messages = encode_messages
    if _crashes(module.encode_messages):
        raise PatchUnavailable(f"{UPSTREAM} could not be wrapped")
    return True
