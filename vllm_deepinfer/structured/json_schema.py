"""One JSON-Schema pipeline for every structured-output path (so_args, response_format,
the recipe's json constraints): the schema is rewritten into one whose every keyword
xgrammar 0.2.8 enforces, or refused naming the keyword and where it sits.

What xgrammar does with a schema (its converter, checked against its matcher):
- a node with `$ref`, `const`, `enum` or `anyOf`/`oneOf`/`allOf` applies that keyword
  only and ignores its siblings; `oneOf` whose branches it cannot prove disjoint is
  decoded as `anyOf`; a node without `type` ignores string/number keywords;
- `not`, `if`/`then`/`else`, `dependentRequired`/`dependentSchemas`/`dependencies`,
  `uniqueItems`, `contains`, `multipleOf` are ignored;
- `required` names that `properties` does not list are dropped.

So siblings are folded into the applying keyword where that is exact (`enum` values
filtered by them, spread over `anyOf`/`oneOf` branches, `allOf` branches merged), a
missing `type` is set from the keywords present (a narrowing: any output still
validates), `required` names missing from `properties` are listed, and every other
ignored keyword is refused. Keywords outside JSON Schema's vocabularies are annotations,
as the standard says (validators ignore them too). Length-limited strings admit raw
control characters in xgrammar's grammar: `so_args.json_grammar` fixes that in the
grammar it makes.
"""

from __future__ import annotations

import json
from typing import Any

_BY_TYPE = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "array": {"items", "prefixItems", "minItems", "maxItems", "unevaluatedItems"},
    "object": {
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "unevaluatedProperties",
    },
}
_APPLYING = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_REFUSED = {
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "multipleOf",
    "additionalItems",
    "$dynamicRef",
    "$recursiveRef",
}
_DEFINITIONS = ("$defs", "definitions")
# Keywords whose meaning depends on a sibling: never merged across allOf/anyOf parts.
_COUPLED = (
    {"properties", "patternProperties", "additionalProperties", "unevaluatedProperties"},
    {"prefixItems", "items", "unevaluatedItems"},
)
_ASSERTIONS = set().union(*_BY_TYPE.values(), _APPLYING, _REFUSED, {"type"})


class StructuredOutputError(ValueError):
    """A structured-output constraint that cannot be used, with the reason."""


def unsupported(keyword: str, path: str, why: str = "") -> StructuredOutputError:
    return StructuredOutputError(
        f"unsupported JSON Schema keyword {keyword!r} at {path}" + (f": {why}" if why else "")
    )


def enforceable_schema(schema: Any) -> Any:
    """A copy of the schema that xgrammar enforces exactly or more narrowly;
    StructuredOutputError naming the first keyword it would ignore."""
    return _Walker(schema).node(schema, "$")


class _Walker:
    """Rewrites node by node, from the root (which `$ref`s point into)."""

    def __init__(self, root: Any):
        self.root = root

    def node(self, node: Any, path: str) -> Any:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            raise StructuredOutputError(
                f"invalid JSON Schema at {path}: a schema is an "
                f"object or a boolean, got {json.dumps(node)[:40]}"
            )
        node = _draft4_bounds(_tuple_items(dict(node)))
        if node.get("uniqueItems") is False:
            del node["uniqueItems"]
        refused = sorted(_REFUSED & node.keys())
        if refused:
            raise unsupported(refused[0], path, "xgrammar does not enforce it")
        if "allOf" in node:
            return self.node(_merged_all_of(node, path), path)
        if "$ref" in node:
            return self._ref(node, path)
        if "const" in node or "enum" in node:
            return self._values(node, path)
        for keyword in ("anyOf", "oneOf"):
            if keyword in node:
                return self._branches(node, keyword, path)
        return self._typed(node, path)

    def _ref(self, node: dict, path: str) -> dict:
        ref = node["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise unsupported(
                "$ref", path, f"only references inside the schema are supported, got {ref!r}"
            )
        _no_siblings(node, "$ref", path)
        return self._definitions(node, path)

    def _values(self, node: dict, path: str) -> dict:
        """const/enum with assertion siblings: keeps the values the siblings accept."""
        import jsonschema

        keyword = "const" if "const" in node else "enum"
        values = [node["const"]] if keyword == "const" else node["enum"]
        if not isinstance(values, list):
            raise StructuredOutputError(f"invalid JSON Schema at {path}: enum must be a list")
        siblings = {k: v for k, v in node.items() if k in _ASSERTIONS and k != keyword}
        if not siblings:
            return self._definitions(node, path)
        if "$ref" in json.dumps(siblings):
            _no_siblings(node, keyword, path)
        kept = [v for v in values if jsonschema.Draft202012Validator(siblings).is_valid(v)]
        if not kept:
            raise StructuredOutputError(
                f"unsatisfiable JSON Schema at {path}: no {keyword} "
                f"value satisfies {sorted(siblings)}"
            )
        rest = {k: v for k, v in node.items() if k not in siblings}
        return self._definitions(
            {**rest, keyword: kept[0]} if keyword == "const" else {**rest, "enum": kept}, path
        )

    def _branches(self, node: dict, keyword: str, path: str) -> dict:
        branches = node[keyword]
        if not isinstance(branches, list) or not branches:
            raise StructuredOutputError(
                f"invalid JSON Schema at {path}: {keyword} must be a non-empty list"
            )
        other = "oneOf" if keyword == "anyOf" else "anyOf"
        if other in node:
            raise unsupported(other, path, f"xgrammar applies only {keyword!r} here")
        siblings = {k: v for k, v in node.items() if k in _ASSERTIONS and k != keyword}
        merged = [_merge(siblings, b, f"{path}.{keyword}[{i}]") for i, b in enumerate(branches)]
        walked = [self.node(b, f"{path}.{keyword}[{i}]") for i, b in enumerate(merged)]
        if keyword == "oneOf" and not self._disjoint(walked):
            raise unsupported(
                "oneOf",
                path,
                "its branches may overlap, and xgrammar decodes overlapping branches as anyOf",
            )
        rest = {k: v for k, v in node.items() if k not in siblings}
        return self._definitions({**rest, keyword: walked}, path)

    def _typed(self, node: dict, path: str) -> dict:
        types = node.get("type")
        if types is None:
            inferred = sorted(t for t, words in _BY_TYPE.items() if words & node.keys())
            if inferred:
                node["type"] = types = inferred[0] if len(inferred) == 1 else inferred
        type_set = {types} if isinstance(types, str) else set(types or ())
        if "object" in type_set:
            self._object(node, path)
        if "array" in type_set:
            self._array(node, path)
        if "string" in type_set and ("minLength" in node or "maxLength" in node):
            _length_limits(node, path)
        return self._definitions(node, path)

    def _object(self, node: dict, path: str) -> None:
        for keyword in ("properties", "patternProperties"):
            if isinstance(node.get(keyword), dict):
                node[keyword] = {
                    name: self.node(s, f"{path}.{keyword}.{name}")
                    for name, s in node[keyword].items()
                }
        for keyword in ("additionalProperties", "unevaluatedProperties", "propertyNames"):
            if isinstance(node.get(keyword), dict):
                node[keyword] = self.node(node[keyword], f"{path}.{keyword}")
        required = node.get("required")
        if isinstance(required, list) and required:
            # xgrammar enforces only the required names that `properties` lists.
            properties = node.get("properties")
            listed: dict = properties if isinstance(properties, dict) else {}
            missing = {
                name: True for name in required if isinstance(name, str) and name not in listed
            }
            if missing:
                node["properties"] = {**listed, **missing}

    def _array(self, node: dict, path: str) -> None:
        for keyword in ("items", "unevaluatedItems"):
            if isinstance(node.get(keyword), dict):
                node[keyword] = self.node(node[keyword], f"{path}.{keyword}")
        if isinstance(node.get("prefixItems"), list):
            node["prefixItems"] = [
                self.node(s, f"{path}.prefixItems[{i}]") for i, s in enumerate(node["prefixItems"])
            ]

    def _definitions(self, node: dict, path: str) -> dict:
        for keyword in _DEFINITIONS:
            if isinstance(node.get(keyword), dict):
                node[keyword] = {
                    name: self.node(s, f"{path}.{keyword}.{name}")
                    for name, s in node[keyword].items()
                }
        return node

    def _disjoint(self, branches: list) -> bool:
        """Whether no value can satisfy two of the branches: told by their types, their
        const/enum values, or one required property whose const/enum values differ."""

        def pairwise(sets) -> bool:
            sets = list(sets)
            return None not in sets and all(
                not (a & b) for i, a in enumerate(sets) for b in sets[i + 1 :]
            )

        resolved = [self._resolve(b) for b in branches]
        return (
            pairwise(map(_type_set, resolved))
            or pairwise(map(_value_set, resolved))
            or any(
                pairwise(_value_set(_property(b, name)) for b in resolved)
                for name in _required_in_all(resolved)
            )
        )

    def _resolve(self, node: Any) -> Any:
        seen = 0
        while isinstance(node, dict) and "$ref" in node and seen < 32:
            node, seen = _pointer(self.root, node["$ref"]), seen + 1
        return node


def _no_siblings(node: dict, keyword: str, path: str) -> None:
    siblings = sorted(k for k in node if k in _ASSERTIONS and k != keyword)
    if siblings:
        raise unsupported(siblings[0], path, f"xgrammar ignores it beside {keyword!r}")


def _tuple_items(node: dict) -> dict:
    """Draft 4-7 tuple `items: [...]` (+ `additionalItems`) as 2020-12 `prefixItems`."""
    if isinstance(node.get("items"), list):
        node["prefixItems"] = node.pop("items")
        if "additionalItems" in node:
            node["items"] = node.pop("additionalItems")
    elif "additionalItems" in node and "prefixItems" not in node:
        del node["additionalItems"]  # without a tuple it applies to nothing
    return node


def _draft4_bounds(node: dict) -> dict:
    """Draft 4's boolean exclusiveMinimum/Maximum as the numeric keywords since draft 6."""
    for bound in ("Minimum", "Maximum"):
        exclusive, inclusive = f"exclusive{bound}", bound.lower()
        if isinstance(node.get(exclusive), bool) and node.pop(exclusive) and inclusive in node:
            node[exclusive] = node.pop(inclusive)
    return node


def _merge(part: dict, branch: Any, path: str) -> Any:
    """The schema of `part` and `branch` both holding, as one node, where that is exact:
    no keyword in both (bar equal values, `required` united, `properties` with
    different names) and no keyword coupled to one in the other."""
    if not part or branch is True:
        return dict(part) if branch is True else branch
    if branch is False:
        return False
    if not isinstance(branch, dict):
        return branch  # reported as invalid by the walk
    merged = dict(branch)
    for key, value in part.items():
        if key not in merged or merged[key] == value:
            merged[key] = value
        elif key == "required" and isinstance(value, list) and isinstance(merged[key], list):
            merged[key] = list(dict.fromkeys(merged[key] + value))
        elif (
            key == "properties"
            and isinstance(value, dict)
            and isinstance(merged[key], dict)
            and not value.keys() & merged[key].keys()
        ):
            merged[key] = {**merged[key], **value}
        elif key in _ASSERTIONS:
            raise unsupported(
                key,
                path,
                "it is set both here and on the enclosing schema, which xgrammar cannot combine",
            )
    for coupled in _COUPLED:
        mine, theirs = coupled & part.keys(), coupled & branch.keys()
        if mine and theirs and mine | theirs != {"properties"}:
            raise unsupported(
                sorted(mine)[0],
                path,
                "it depends on keywords of the enclosing schema, which xgrammar cannot combine",
            )
    return merged


def _merged_all_of(node: dict, path: str) -> Any:
    branches = node.pop("allOf")
    if not isinstance(branches, list):
        raise StructuredOutputError(f"invalid JSON Schema at {path}: allOf must be a list")
    merged: Any = node
    for i, branch in enumerate(branches):
        merged = (
            _merge(merged, branch, f"{path}.allOf[{i}]") if isinstance(merged, dict) else merged
        )
    return merged


def _pointer(root: Any, ref: str) -> Any:
    node = root
    for part in ref.lstrip("#").split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise StructuredOutputError(f"unresolvable $ref {ref!r}")
    return node


def _type_set(node: Any) -> set | None:
    if not isinstance(node, dict):
        return None
    if "const" in node or "enum" in node:
        values = [node["const"]] if "const" in node else node["enum"]
        return {_json_type(v) for v in values}
    types = node.get("type")
    if types is None:
        return None
    found = {types} if isinstance(types, str) else set(types)
    return found | {"integer"} if "number" in found else found


_JSON_TYPE_NAMES: dict[type, str] = {str: "string", list: "array", dict: "object"}


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "integer" if float(value).is_integer() else "number"
    return _JSON_TYPE_NAMES.get(type(value), "null")


def _value_set(node: Any) -> set | None:
    if isinstance(node, dict) and ("const" in node or "enum" in node):
        values = [node["const"]] if "const" in node else node["enum"]
        return {json.dumps(_same_numbers(v), sort_keys=True) for v in values}
    return None


def _same_numbers(value: Any) -> Any:
    """The value with every number a float, as JSON Schema compares them (1 == 1.0)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, list):
        return [_same_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: _same_numbers(v) for k, v in value.items()}
    return value


def _required_in_all(branches: list) -> set:
    names = None
    for branch in branches:
        required = set(branch.get("required") or ()) if isinstance(branch, dict) else set()
        names = required if names is None else names & required
    return names or set()


def _property(node: dict, name: str) -> Any:
    return (node.get("properties") or {}).get(name)


def _length_limits(node: dict, path: str) -> None:
    """Length limits xgrammar enforces: valid counts, and no pattern or format beside."""
    for keyword in ("pattern", "format"):
        if keyword in node:
            limit = "minLength" if "minLength" in node else "maxLength"
            raise unsupported(
                limit, path, f"xgrammar cannot limit the length of a string that has a {keyword!r}"
            )
    low, high = node.get("minLength", 0), node.get("maxLength")
    if not _count(low) or not (high is None or _count(high)) or (high is not None and high < low):
        raise StructuredOutputError(
            f"invalid string length limits minLength={low!r} maxLength={high!r} at {path}"
        )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def with_dropped_keywords(normalised: Any, original: Any) -> Any:
    """The protocol's normalisation of a user's schema (the recipe's strict mode closes
    every object it reads and drops the keywords it does not know: length limits, const,
    $defs, ...) with every dropped keyword put back, and the objects of put-back
    definitions closed as the normalisation closes the rest. The pipeline then enforces
    or refuses them like any other."""
    if (
        isinstance(normalised, list)
        and isinstance(original, list)
        and len(normalised) == len(original)
    ):
        return [with_dropped_keywords(n, o) for n, o in zip(normalised, original)]
    if not (isinstance(normalised, dict) and isinstance(original, dict)):
        return normalised
    merged = {
        key: with_dropped_keywords(value, original[key]) if key in original else value
        for key, value in normalised.items()
    }
    closing = (
        normalised.get("additionalProperties") is False and "additionalProperties" not in original
    )
    for key, value in original.items():
        if key not in merged:
            merged[key] = _closed_definitions(value) if closing and key in _DEFINITIONS else value
    return merged


def _closed_definitions(definitions: Any) -> Any:
    if not isinstance(definitions, dict):
        return definitions
    return {name: _closed(schema) for name, schema in definitions.items()}


def _closed(node: Any) -> Any:
    """additionalProperties false on every object of the schema that does not set it."""
    if isinstance(node, list):
        return [_closed(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {
        key: _closed(value)
        if key in _SUBSCHEMAS
        else {name: _closed(s) for name, s in value.items()}
        if key in _SCHEMA_MAPS and isinstance(value, dict)
        else value
        for key, value in node.items()
    }
    types = node.get("type")
    if (
        types == "object" or isinstance(types, list) and "object" in types
    ) and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = {"items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties"}
_SCHEMA_MAPS = {"properties", "patternProperties", *_DEFINITIONS}


SAFE_CHAR = r'[^\x00-\x1f"\\]'
MAX_REPEAT = 128  # the largest regex repeat bound xgrammar compiles inside a schema


def length_limits_as_patterns(schema: Any) -> Any:
    """The checked schema with each length-limited string a pattern over characters valid
    unescaped in JSON, for where xgrammar's JSON-Schema converter itself applies it (a
    structural tag): its own length rule admits raw control characters there, and some
    argument styles do not enforce it. Repeat bounds stay at most MAX_REPEAT (xgrammar,
    compiled as vLLM compiles it, refuses larger ones). A plain JSON constraint takes
    `so_args.json_grammar` instead, whose limits compile in time independent of size."""
    if isinstance(schema, list):
        return [length_limits_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: length_limits_as_patterns(value) for key, value in schema.items()}
    types = out.get("type")
    strings = types == "string" or isinstance(types, list) and "string" in types
    if (
        not strings
        or not {"minLength", "maxLength"} & out.keys()
        or {"pattern", "format", "enum", "const"} & out.keys()
    ):
        return out
    low, high = out.pop("minLength", 0), out.pop("maxLength", None)
    string = {"type": "string", "pattern": f"^{length_pattern(low, high)}$"}
    if types == "string":
        return {**out, **string}
    rest = [t for t in out["type"] if t != "string"]  # a list: "string" alone returned above
    return {"anyOf": [string, {**out, "type": rest[0] if len(rest) == 1 else rest}]}


def length_pattern(low: int, high: int | None, char: str = SAFE_CHAR) -> str:
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
