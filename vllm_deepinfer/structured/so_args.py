"""DeepInfer's `so_args = {"schema_type": "json" | "regex" | "ebnf", "schema": ...}`.

Each constraint is checked with xgrammar before it reaches the engine, so a bad schema,
regex or grammar fails its own request with a message naming the problem and never
reaches the engine's compiler.

JSON Schema strings with `minLength`/`maxLength` are rewritten to an equivalent length
`pattern` over characters that need no escaping: xgrammar 0.2.8 compiles length-limited
strings to a rule that admits raw control characters, which strict `json.loads` rejects.
"""
from __future__ import annotations

import copy
import json
from typing import Any

import xgrammar as xgr
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams

SCHEMA_TYPES = ("json", "regex", "ebnf")
_SAFE_CHAR = r'[^\x00-\x1f"\\]'


class StructuredOutputError(ValueError):
    """An so_args constraint that cannot be used, with the reason."""


def strict_json_schema(schema: Any) -> Any:
    """A copy of the schema whose length-limited strings admit only characters that are
    valid unescaped in JSON (no control characters, quotes or backslashes)."""
    if isinstance(schema, list):
        return [strict_json_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict_json_schema(value) for key, value in schema.items()}
    limited = "minLength" in out or "maxLength" in out
    if (out.get("type") == "string" and limited
            and not {"pattern", "format", "enum", "const"} & out.keys()):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{_SAFE_CHAR}{{{low},{high}}}$"
    return out


def _json_schema(schema: Any) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise StructuredOutputError(f"so_args schema is not valid JSON: {e}") from e
    if not isinstance(schema, dict):
        raise StructuredOutputError("so_args schema for schema_type 'json' must be a JSON "
                                    f"Schema object, got {type(schema).__name__}")
    strict = strict_json_schema(copy.deepcopy(schema))
    _check(lambda: xgr.Grammar.from_json_schema(json.dumps(strict)), "JSON Schema")
    return strict


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
        raise StructuredOutputError(f"so_args schema_type must be one of {SCHEMA_TYPES}, "
                                    f"got {schema_type!r}")
    if schema is None:
        raise StructuredOutputError("so_args needs a schema")
    if schema_type == "json":
        return StructuredOutputsParams(json=_json_schema(schema))
    if not isinstance(schema, str) or not schema:
        raise StructuredOutputError(f"so_args schema for schema_type {schema_type!r} must be "
                                    "a non-empty string")
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
