"""DeepInfer's `so_args = {"schema_type": "json" | "regex" | "ebnf", "schema": ...}`.

Each constraint is checked with xgrammar before it reaches the engine, so a bad schema,
regex or grammar fails its own request with a message naming the problem and never
reaches the engine's compiler. A JSON Schema goes through `json_schema.enforceable_schema`
(every keyword enforced or refused naming it and its path) and vLLM's own request check,
and reaches the engine as the grammar xgrammar makes of it (compact JSON), with its
length-limited strings kept to characters valid unescaped in JSON: xgrammar 0.2.8 lets
raw control characters into them, and a regex of the same limits compiles in time
quadratic in the limit (and not at all for repeat bounds of 129 to a few thousand). The
grammar is compiled up front with the engine's compiler settings over a byte
vocabulary; over the real tokenizer as well by `engine_compiled(llm, params)` offline
and by the server's GrammarCompilePool before every request.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import xgrammar as xgr
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams

from vllm_deepinfer.structured.json_schema import (
    StructuredOutputError,
    enforceable_schema,
    length_limits_as_patterns,
)

__all__ = [
    "SCHEMA_TYPES",
    "StructuredOutputError",
    "checked_json_schema",
    "engine_compiled",
    "json_grammar",
    "sampling_params",
    "to_structured_outputs",
]

SCHEMA_TYPES = ("json", "regex", "ebnf")


def _refusal_path(schema: Any, path: str = "$") -> str:
    """The deepest node vLLM's xgrammar check refuses (its own check, node by node)."""
    from vllm.v1.structured_output.backend_xgrammar import has_xgrammar_unsupported_json_features

    children = []
    if isinstance(schema, dict):
        children = [(f"{path}.{key}", value) for key, value in schema.items()]
    elif isinstance(schema, list):
        children = [(f"{path}[{i}]", value) for i, value in enumerate(schema)]
    for child_path, child in children:
        wrapped = (
            child
            if isinstance(child, dict)
            else {"anyOf": child}
            if isinstance(child, list)
            else None
        )
        if wrapped is not None and has_xgrammar_unsupported_json_features(wrapped):
            return _refusal_path(child, child_path)
    return path


def _check_vllm_accepts(schema: dict) -> None:
    """vLLM's own request check (the one `generate` runs), so that nothing accepted here
    is refused by the engine."""
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        validate_xgrammar_grammar(
            SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
        )
    except VLLMValidationError as e:
        raise StructuredOutputError(
            f"unsupported JSON Schema at {_refusal_path(schema)}: {e}"
        ) from e


def checked_json_schema(schema: Any) -> dict:
    """The schema as xgrammar's JSON-Schema converter should get it where it applies the
    schema itself (structural tags): every keyword enforced, length limits as patterns
    (json_schema.length_limits_as_patterns); StructuredOutputError if not. A plain JSON
    constraint takes `json_grammar`."""
    return length_limits_as_patterns(_enforced_schema(schema))


def _enforced_schema(schema: Any) -> dict:
    """The schema (object or JSON text) with every keyword enforced by xgrammar, parsed
    by xgrammar and accepted by vLLM's own request check; StructuredOutputError if not."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise StructuredOutputError(f"so_args schema is not valid JSON: {e}") from e
    if not isinstance(schema, dict):
        raise StructuredOutputError(
            "so_args schema for schema_type 'json' must be a JSON "
            f"Schema object, got {type(schema).__name__}"
        )
    enforced = enforceable_schema(schema)
    _check(lambda: xgr.Grammar.from_json_schema(json.dumps(enforced)), "JSON Schema")
    _check_vllm_accepts(enforced)
    return enforced


# xgrammar's character classes for string contents (length-limited, and plain), and the
# one a JSON string allows: no raw control character, and no surrogate code point
# (xgrammar emits one as three bytes that are not UTF-8, which decode to three U+FFFD
# and break the length limit).
_STRING_CHARS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
_JSON_CHAR = r"[^\0-\x1f\"\\\ud800-\udfff]"


def json_grammar(schema: Any) -> str:
    """The EBNF grammar the engine gets for a JSON constraint (every path: so_args,
    response_format, the recipe's): xgrammar's grammar of the checked schema, compact,
    with no raw control character or surrogate in strings; compiled with the
    engine's compiler settings. StructuredOutputError if any step refuses it."""
    grammar = str(
        xgr.Grammar.from_json_schema(
            json.dumps(_enforced_schema(schema)),
            any_whitespace=False,
            separators=(",", ":"),
            strict_mode=True,
        )
    )
    for chars in _STRING_CHARS:
        grammar = grammar.replace(chars, _JSON_CHAR)
    _check(lambda: _byte_compiler().compile_grammar(grammar), "JSON Schema")
    return grammar


@functools.lru_cache(maxsize=1)
def _byte_compiler() -> xgr.GrammarCompiler:
    """The engine's compiler settings (caching on, as vLLM compiles) over one token per
    byte: small enough to compile in milliseconds, and the grammar is the same."""
    vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[256])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)


def engine_compiled(llm, params: list[SamplingParams]) -> None:
    """Compiles the constraints of `params` exactly as `llm`'s engine will (vLLM's
    xgrammar backend, the model's tokenizer, the engine's structured-outputs config), so
    a batch for `LLM.generate` is refused before anything is submitted;
    StructuredOutputError names the first constraint that does not compile."""
    from vllm.v1.structured_output.request import get_structured_output_key

    backend = _engine_backend(llm)
    for params_i in params:
        if params_i.structured_outputs is None:
            continue
        request_type, spec = get_structured_output_key(params_i.structured_outputs)
        try:
            backend.compile_grammar(request_type, spec)
        except Exception as e:  # noqa: BLE001 - any compile failure refuses the batch
            raise StructuredOutputError(
                f"the constraint does not compile for this engine: {e}"
            ) from e


def _engine_backend(llm):
    """One xgrammar backend per LLM, made as its engine makes its own."""
    backend = getattr(llm, "_deepinfer_xgrammar_backend", None)
    if backend is None:
        from vllm_deepinfer.structured.compile_pool import xgrammar_backend

        backend = llm._deepinfer_xgrammar_backend = xgrammar_backend(llm.llm_engine.vllm_config)
    return backend


def _check(build, what: str) -> None:
    try:
        build()
    except (RuntimeError, ValueError) as e:
        reason = str(e).split("] ", 1)[-1].split(": ", 1)[-1].strip()
        raise StructuredOutputError(f"invalid {what}: {reason}") from e


def to_structured_outputs(so_args: Any) -> StructuredOutputsParams:
    """Validates so_args and maps it onto vLLM's structured-outputs parameters."""
    if not isinstance(so_args, dict):
        raise StructuredOutputError(f"so_args must be an object, got {type(so_args).__name__}")
    unknown = set(so_args) - {"schema_type", "schema"}
    if unknown:
        raise StructuredOutputError(f"so_args has unknown fields {sorted(unknown)}")
    schema_type, schema = so_args.get("schema_type"), so_args.get("schema")
    if schema_type not in SCHEMA_TYPES:
        raise StructuredOutputError(
            f"so_args schema_type must be one of {SCHEMA_TYPES}, got {schema_type!r}"
        )
    if schema is None:
        raise StructuredOutputError("so_args needs a schema")
    if schema_type == "json":
        return StructuredOutputsParams(grammar=json_grammar(schema))
    if not isinstance(schema, str) or not schema:
        raise StructuredOutputError(
            f"so_args schema for schema_type {schema_type!r} must be a non-empty string"
        )
    if schema_type == "regex":
        _check(lambda: xgr.Grammar.from_regex(schema), "regex")
        return StructuredOutputsParams(regex=schema)
    _check(lambda: xgr.Grammar.from_ebnf(schema), "EBNF grammar")
    return StructuredOutputsParams(grammar=schema)


def sampling_params(so_args: dict | None = None, **kwargs) -> SamplingParams:
    """vLLM SamplingParams with DeepInfer's `so_args`: `sampling_params(so_args={...},
    max_tokens=64)` for `LLM.generate`."""
    if so_args is not None:
        kwargs["structured_outputs"] = to_structured_outputs(so_args)
    return SamplingParams(**kwargs)
