"""Request fields deepseek-recipe does not carry into `InferenceOptions`, read from the
raw JSON body and passed to vLLM's `SamplingParams`: one table per protocol.

The recipe keeps what it encodes of the official DeepSeek API: in thinking mode sampling
is fixed (temperature 1.0, the recipe's `top_p`), so the fields marked `thinking_fixed`
apply only with thinking off. Everything else the recipe already carries (temperature,
seed, max_tokens, stop sequences, logprobs) comes from its `InferenceOptions`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


class RequestFieldError(ValueError):
    """A field with a wrong type or value; the message names the field."""


def _number(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestFieldError(f"{name} must be a number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        low_bracket = "(" if low_open else "["
        raise RequestFieldError(f"{name} must be in {low_bracket}{low:g}, {high:g}], got {value!r}")
    return float(value)


def _penalty(name: str, value, vocab_size: int | None) -> float:
    return _number(name, value, -2.0, 2.0)


def _top_p(name: str, value, vocab_size: int | None) -> float:
    return _number(name, value, 0.0, 1.0, low_open=True)


def _top_k(name: str, value, vocab_size: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise RequestFieldError(
            f"{name} must be an integer >= 1 (0 or -1: no limit), got {value!r}"
        )
    return value


def _logit_bias(name: str, value, vocab_size: int | None) -> dict[int, float]:
    """{"token id": bias} as vLLM takes it: biases clamped to [-100, 100], ids checked
    against the vocabulary."""
    if not isinstance(value, dict):
        raise RequestFieldError(f"{name} must be an object mapping token ids to biases")
    bias = {}
    for key, amount in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise RequestFieldError(f"{name} keys must be token ids, got {key!r}") from None
        if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            raise RequestFieldError(
                f"{name} token id {token_id} is outside the vocabulary"
                + (f" of {vocab_size} tokens" if vocab_size else "")
            )
        bias[token_id] = max(
            -100.0, min(100.0, _number(f"{name}[{key!r}]", amount, -math.inf, math.inf))
        )
    return bias


def _seed(name: str, value, vocab_size: int | None) -> int:
    """A 64-bit signed integer, as vLLM takes it."""
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**63:
        raise RequestFieldError(f"{name} must be a 64-bit integer, got {value!r}")
    return value


MAX_CHOICES = 128  # OpenAI's bound on `n`


def _n(name: str, value, vocab_size: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHOICES:
        raise RequestFieldError(f"{name} must be an integer in [1, {MAX_CHOICES}], got {value!r}")
    return value


@dataclass(frozen=True)
class RequestField:
    name: str  # in the request body
    param: str  # SamplingParams argument
    parse: Callable[[str, object, int | None], object]
    thinking_fixed: bool = False  # the recipe fixes it in thinking mode


_TOP_P = RequestField("top_p", "top_p", _top_p, thinking_fixed=True)
# The recipe carries Chat's `seed`; Responses and Messages take it as vLLM does.
_SEED = RequestField("seed", "seed", _seed)
# DeepInfer's name for the per-request seed (deterministic sampling keys its draws by it).
_SEQ_SEED = RequestField("seq_seed", "seed", _seed)
_PENALTIES = (
    RequestField("frequency_penalty", "frequency_penalty", _penalty),
    RequestField("presence_penalty", "presence_penalty", _penalty),
)
CHAT_FIELDS = (
    _TOP_P,
    *_PENALTIES,
    RequestField("logit_bias", "logit_bias", _logit_bias),
    RequestField("n", "n", _n),
    _SEQ_SEED,
)
RESPONSES_FIELDS = (_TOP_P, _SEED, _SEQ_SEED)
MESSAGES_FIELDS = (
    _TOP_P,
    RequestField("top_k", "top_k", _top_k, thinking_fixed=True),
    _SEED,
    _SEQ_SEED,
)


def read_fields(
    fields: tuple[RequestField, ...], body: dict, vocab_size: int | None
) -> dict[RequestField, object]:
    """The table's fields present (and not null) in `body`, checked and converted. Runs
    before the recipe parses the body, so a wrong type is refused naming its field, and
    two names of one parameter (`seed` / `seq_seed`) must agree."""
    values = {
        field: field.parse(field.name, body[field.name], vocab_size)
        for field in fields
        if body.get(field.name) is not None
    }
    if "seq_seed" in body and body.get("seed") is not None and body.get("seq_seed") is not None:
        seed = _seed("seed", body["seed"], vocab_size)
        if seed != values[_SEQ_SEED]:
            raise RequestFieldError(
                f"seed ({seed}) and seq_seed ({values[_SEQ_SEED]}) name the "
                "same per-request seed; give one, or the same value"
            )
    return values


def sampling_overrides(values: dict[RequestField, object], thinking: bool) -> dict:
    """SamplingParams arguments for the fields read, less those thinking mode fixes."""
    return {
        field.param: value
        for field, value in values.items()
        if not (thinking and field.thinking_fixed)
    }


def chat_body(body: dict) -> dict | None:
    """The Chat Completions body as the recipe takes it, or None when it needs no change:
    the `developer` role is a system message (as OpenAI treats it), and
    `max_completion_tokens`, which OpenAI prefers over `max_tokens`, is the recipe's
    `max_tokens` (so the recipe checks it against the context as it does max_tokens);
    `n`, which the recipe refuses above 1, is the service's (one stream per choice)."""
    changed = dict(body)
    messages = body.get("messages")
    if isinstance(messages, list) and any(
        isinstance(m, dict) and m.get("role") == "developer" for m in messages
    ):
        changed["messages"] = [
            {**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
            for m in messages
        ]
    limit = body.get("max_completion_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise RequestFieldError(
                f"max_completion_tokens must be a positive integer, got {limit!r}"
            )
        changed["max_tokens"] = limit
    changed.pop("max_completion_tokens", None)
    changed.pop("n", None)
    return changed if changed != body else None
