"""DeepInfer's `so_args = {"schema_type": "json" | "regex" | "ebnf", "schema": ...}`.

Each constraint is checked with xgrammar before it reaches the engine, so a bad schema,
regex or grammar fails its own request with a message naming the problem and never
reaches the engine's compiler.

JSON Schema strings with `minLength`/`maxLength` (also where `type` is a list holding
"string") are rewritten to an equivalent length `pattern` over characters that need no
escaping: xgrammar 0.2.8 compiles length-limited strings to a rule that admits raw control
characters, which strict `json.loads` rejects. The pattern's repeat bounds stay at most
128 (xgrammar, compiled as vLLM compiles it, refuses larger ones), so long limits nest.
`required` names that `properties` does not list are added to it (xgrammar drops them).
A schema vLLM's own request check would refuse is refused here, naming the node.
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
MAX_REPEAT = 128  # the largest regex repeat bound xgrammar compiles inside a schema


class StructuredOutputError(ValueError):
    """An so_args constraint that cannot be used, with the reason."""


def length_pattern(low: int, high: int | None, char: str = _SAFE_CHAR) -> str:
    """A regex for `low`..`high` (None: unbounded) repeats of `char` whose repeat bounds
    never exceed MAX_REPEAT (fixed runs are split into blocks of MAX_REPEAT)."""
    blocks, rest = divmod(low, MAX_REPEAT)
    fixed = _blocks(blocks, char) + (f"{char}{{{rest}}}" if rest else "")
    if high is None:
        return fixed + f"{char}*"
    return fixed + _optional_run(high - low, char)


def _blocks(count: int, char: str) -> str:
    return f"(?:{char}{{{MAX_REPEAT}}}){{{count}}}" if count else ""


def _optional_run(n: int, char: str) -> str:
    """0..n repeats of char: below q whole blocks any remainder up to a block, or q whole
    blocks and the last r (n = q * MAX_REPEAT + r)."""
    q, r = divmod(n, MAX_REPEAT)
    if q == 0:
        return f"{char}{{0,{r}}}" if r else ""
    below = f"(?:{char}{{{MAX_REPEAT}}}){{0,{q - 1}}}{char}{{0,{MAX_REPEAT - 1}}}"
    return f"(?:{below}|{_blocks(q, char)}{char}{{0,{r}}})"


def _length_limited_string(node: dict) -> dict:
    low, high = node.pop("minLength", 0), node.pop("maxLength", None)
    if not isinstance(low, int) or not (high is None or isinstance(high, int)) or low < 0 \
            or (high is not None and high < low):
        raise StructuredOutputError(f"invalid string length limits minLength={low!r} "
                                    f"maxLength={high!r}")
    return {**node, "pattern": f"^{length_pattern(low, high)}$"}


def strict_json_schema(schema: Any) -> Any:
    """A copy of the schema whose length-limited strings admit only characters that are
    valid unescaped in JSON (no control characters, quotes or backslashes), and whose
    required properties are all listed."""
    if isinstance(schema, list):
        return [strict_json_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict_json_schema(value) for key, value in schema.items()}
    required, properties = out.get("required"), out.get("properties")
    if isinstance(required, list) and isinstance(properties, dict):
        missing = [name for name in required if isinstance(name, str) and name not in properties]
        out["properties"] = {**properties, **{name: {} for name in missing}}
    elif isinstance(required, list) and required and properties is None:
        out["properties"] = {name: {} for name in required if isinstance(name, str)}
    limited = "minLength" in out or "maxLength" in out
    if not limited or {"pattern", "format", "enum", "const"} & out.keys():
        return out
    types = out.get("type")
    if types == "string":
        return _length_limited_string(out)
    if isinstance(types, list) and "string" in types:
        # ["string", "null"] and the like: the string branch gets the pattern.
        string = _length_limited_string({**out, "type": "string"})
        rest = [t for t in types if t != "string"]
        other = {k: v for k, v in out.items() if k not in ("minLength", "maxLength")}
        other["type"] = rest[0] if len(rest) == 1 else rest
        return {"anyOf": [string, other]}
    return out


def _refusal_path(schema: Any, path: str = "$") -> str:
    """The deepest node vLLM's xgrammar check refuses (its own check, node by node)."""
    from vllm.v1.structured_output.backend_xgrammar import has_xgrammar_unsupported_json_features

    children = []
    if isinstance(schema, dict):
        children = [(f"{path}.{key}", value) for key, value in schema.items()]
    elif isinstance(schema, list):
        children = [(f"{path}[{i}]", value) for i, value in enumerate(schema)]
    for child_path, child in children:
        wrapped = child if isinstance(child, dict) else {"anyOf": child} \
            if isinstance(child, list) else None
        if wrapped is not None and has_xgrammar_unsupported_json_features(wrapped):
            return _refusal_path(child, child_path)
    return path


def _check_vllm_accepts(schema: dict) -> None:
    """vLLM's own request check (the one `generate` runs), so that nothing accepted here
    is refused by the engine."""
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        validate_xgrammar_grammar(SamplingParams(
            structured_outputs=StructuredOutputsParams(json=schema)))
    except VLLMValidationError as e:
        raise StructuredOutputError(f"unsupported JSON Schema at {_refusal_path(schema)}: "
                                    f"{e}") from e


def checked_json_schema(schema: Any) -> dict:
    """The schema (object or JSON text) as the engine gets it: strict-rewritten, parsed
    by xgrammar and accepted by vLLM's own request check; StructuredOutputError if not.
    Every JSON constraint (so_args, response_format, the recipe's) goes through here."""
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
    _check_vllm_accepts(strict)
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
        return StructuredOutputsParams(json=checked_json_schema(schema))
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
