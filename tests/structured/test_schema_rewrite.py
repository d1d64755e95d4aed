"""The JSON-Schema pipeline, checked with xgrammar's own matcher on the grammar the engine
gets, compiled with the engine's settings (caching on): length limits of any size and no
raw control characters wherever a string sits, every keyword enforced or refused naming
it and its path, and the recipe's strict normalisation keeping the user's keywords."""

import json
import random
import re

import pytest
import xgrammar as xgr

from vllm_deepinfer.structured.json_schema import enforceable_schema, with_dropped_keywords
from vllm_deepinfer.structured.so_args import (
    StructuredOutputError,
    _byte_compiler,
    json_grammar,
    to_structured_outputs,
)

pytestmark = pytest.mark.unit
SAFE = "aZ09 -_.,;:!?/()[]{}<>'=+*&%$#@~^`|éß中😀"  # valid unescaped in a JSON string


def matcher(schema: dict):
    compiled = _byte_compiler().compile_grammar(json_grammar(schema))
    return lambda text: _accepts(compiled, text)


def _accepts(compiled, text: str) -> bool:
    m = xgr.GrammarMatcher(compiled)
    return m.accept_string(text) and m.is_completed()


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(SAFE) for _ in range(n))


POSITIONS = {  # where a string can sit: the schema around it, the JSON around its value
    "top": (lambda s: s, lambda v: v),
    "type list": (lambda s: {**s, "type": ["string", "null"]}, lambda v: v),
    "anyOf": (lambda s: {"anyOf": [s, {"type": "integer"}]}, lambda v: v),
    "oneOf": (lambda s: {"oneOf": [s, {"type": "boolean"}]}, lambda v: v),
    "allOf": (lambda s: {"allOf": [s]}, lambda v: v),
    "items": (lambda s: {"type": "array", "items": s}, lambda v: f"[{v},{v}]"),
    "prefixItems": (
        lambda s: {"type": "array", "prefixItems": [{"type": "integer"}, s], "items": False},
        lambda v: f"[1,{v}]",
    ),
    "properties": (
        lambda s: {"type": "object", "properties": {"k": s}, "required": ["k"]},
        lambda v: f'{{"k":{v}}}',
    ),
    "additionalProperties": (
        lambda s: {"type": "object", "additionalProperties": s},
        lambda v: f'{{"x":{v}}}',
    ),
    "patternProperties": (
        lambda s: {"type": "object", "patternProperties": {"^p": s}},
        lambda v: f'{{"p":{v}}}',
    ),  # xgrammar: the whole key matches
    "$defs via $ref": (
        lambda s: {
            "$defs": {"d": s},
            "type": "object",
            "required": ["k"],
            "properties": {"k": {"$ref": "#/$defs/d"}},
        },
        lambda v: f'{{"k":{v}}}',
    ),
}


@pytest.mark.parametrize("low,high", [(0, 129), (129, 255), (0, 300), (1000, 1000), (200, None)])
@pytest.mark.parametrize("position", list(POSITIONS))
def test_length_limits_and_control_characters_wherever_a_string_sits(position, low, high):
    wrap_schema, wrap_value = POSITIONS[position]
    string = {"type": "string", "minLength": low}
    if high is not None:
        string["maxLength"] = high
    accepts = matcher(wrap_schema(string))
    rng = random.Random(f"{position}-{low}-{high}")
    top = high if high is not None else low + 300
    for n in (low, top, rng.randint(low, top)):
        valid = text(rng, n)
        assert accepts(wrap_value(json.dumps(valid, ensure_ascii=False))), (position, n)
        at = rng.randrange(n + 1)
        control = valid[:at] + chr(rng.randrange(0x20)) + valid[at + 1 :]
        assert not accepts(wrap_value(f'"{control}"')), (position, n, at)
    if high is not None:
        assert not accepts(wrap_value(json.dumps(text(rng, high + 1), ensure_ascii=False)))
    if low:
        assert not accepts(wrap_value(json.dumps(text(rng, low - 1), ensure_ascii=False)))


def test_plain_strings_exclude_control_characters():
    accepts = matcher(
        {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    )
    assert accepts('{"s":"a\\u0001b\\n"}')
    assert not any(accepts(f'{{"s":"a{chr(c)}b"}}') for c in range(0x20))


@pytest.mark.parametrize("string", [{"type": "string"}, {"type": "string", "maxLength": 255}])
def test_strings_exclude_surrogate_code_points(string):
    """xgrammar would emit a surrogate as three bytes that are not UTF-8: they decode to
    three U+FFFD, one character counted as three (a conformance-suite finding)."""
    compiled = _byte_compiler().compile_grammar(json_grammar(string))
    for good, bad in (
        (b'"a\xe4\xb8\xad"', b'"a\xed\xa0\x80"'),
        (b'"\xf0\x9f\x98\x80"', b'"\xed\xbf\xbf"'),
    ):
        assert _accepts(compiled, good) and not _accepts(compiled, bad)


def test_required_names_missing_from_properties_are_enforced():
    accepts = matcher({"type": "object", "properties": {}, "required": ["top"]})
    assert not accepts("{}") and accepts('{"top":1}')
    bare = matcher({"type": "object", "required": ["a", "b"]})
    assert not bare('{"a":1}') and bare('{"a":1,"b":"x"}')


@pytest.mark.parametrize(
    "schema,accepted,refused",
    [
        # siblings of enum/const keep only the values they accept
        ({"type": "string", "enum": ["a", 1, "bb"], "maxLength": 1}, ['"a"'], ["1", '"bb"']),
        # siblings of anyOf/oneOf hold in every branch
        (
            {
                "type": "object",
                "properties": {"k": {"type": "integer"}},
                "required": ["k"],
                "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
            },
            ['{"k":1,"a":2}', '{"k":1,"b":2}'],
            ['"x"', '{"a":2}', '{"k":1}'],
        ),
        # allOf branches merged into one node
        (
            {
                "allOf": [
                    {"type": "object", "properties": {"a": {"type": "integer"}}},
                    {"required": ["a"]},
                ]
            },
            ['{"a":1}'],
            ["{}", '{"a":"x"}'],
        ),
        # no type: the keywords present tell it
        ({"maxLength": 2}, ['"ab"'], ['"abc"']),
        ({"minimum": 3}, ["3"], ["2"]),
        # draft 4 boolean exclusive bounds, draft 7 tuple items
        ({"type": "integer", "minimum": 0, "exclusiveMinimum": True}, ["1"], ["0"]),
        (
            {"type": "array", "items": [{"type": "integer"}], "additionalItems": False},
            ["[1]"],
            ["[1,2]", '["x"]'],
        ),
        # oneOf whose branches are told apart by a required property's values
        (
            {
                "oneOf": [
                    {"type": "object", "properties": {"t": {"const": "a"}}, "required": ["t"]},
                    {
                        "type": "object",
                        "properties": {"t": {"const": "b"}, "n": {"type": "integer"}},
                        "required": ["t", "n"],
                    },
                ]
            },
            ['{"t":"a"}', '{"t":"b","n":1}'],
            ['{"t":"b"}'],
        ),
    ],
)
def test_keywords_xgrammar_ignores_beside_others_are_folded_in(schema, accepted, refused):
    accepts = matcher(schema)
    assert all(accepts(t) for t in accepted) and not any(accepts(t) for t in refused)


@pytest.mark.parametrize(
    "schema,keyword,path",
    [
        (
            {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
            "uniqueItems",
            "$.properties.tags",
        ),
        ({"type": "integer", "not": {"const": 1}}, "not", "$"),
        ({"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 3}}, "if", "$"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", "$"),
        ({"type": "object", "dependencies": {"a": ["b"]}}, "dependencies", "$"),
        (
            {"type": "array", "items": {"type": "array", "contains": {"type": "integer"}}},
            "contains",
            "$.items",
        ),
        ({"type": "number", "multipleOf": 3}, "multipleOf", "$"),
        ({"$defs": {"d": {"type": "integer"}}, "$ref": "#/$defs/d", "minimum": 5}, "minimum", "$"),
        ({"$ref": "https://example.com/s.json"}, "$ref", "$"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "$"),
        ({"anyOf": [{"type": "string"}], "oneOf": [{"type": "integer"}]}, "oneOf", "$"),
        (
            {
                "type": "object",
                "properties": {"d": {"type": "string", "format": "email", "maxLength": 9}},
            },
            "maxLength",
            "$.properties.d",
        ),
        (
            {
                "type": "object",
                "additionalProperties": False,
                "anyOf": [{"properties": {"a": {"type": "integer"}}}],
            },
            "additionalProperties",
            "$.anyOf[0]",
        ),
        (
            {"$defs": {"x": {"type": "array", "uniqueItems": True}}, "type": "integer"},
            "uniqueItems",
            "$.$defs.x",
        ),
    ],
)
def test_keywords_xgrammar_would_ignore_are_refused_naming_them(schema, keyword, path):
    with pytest.raises(
        StructuredOutputError,
        match=re.escape(f"unsupported JSON Schema keyword {keyword!r} at {path}"),
    ):
        to_structured_outputs({"schema_type": "json", "schema": schema})


@pytest.mark.parametrize(
    "schema,message",
    [
        ({"type": "string", "minLength": 5, "maxLength": 2}, "invalid string length limits"),
        ({"type": "string", "enum": [1, 2]}, "unsatisfiable JSON Schema at $"),
        (
            {"type": "object", "properties": {"x": {"type": "string", "format": "color"}}},
            "unsupported JSON Schema at $.properties.x",
        ),  # vLLM's own request check
    ],
)
def test_other_refusals_say_why(schema, message):
    with pytest.raises(StructuredOutputError, match=re.escape(message)):
        to_structured_outputs({"schema_type": "json", "schema": schema})


def test_annotations_and_unknown_keywords_pass():
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$id": "x",
        "title": "T",
        "description": "d",
        "$comment": "c",
        "examples": [1],
        "default": 1,
        "deprecated": False,
        "readOnly": True,
        "writeOnly": False,
        "self": {"v": 1},
        "markdownDescription": "m",
        "type": "integer",
        "minimum": 1,
    }
    assert enforceable_schema(schema) == schema
    assert matcher(schema)("1") and not matcher(schema)("0")


def test_strict_normalisation_keeps_the_users_keywords():
    """The recipe's strict mode closes objects and drops what it does not know; the
    pipeline takes its normalisation with the dropped keywords put back."""
    import deepseek_recipe as dr

    schema = {
        "type": "object",
        "required": ["name", "kind", "ref"],
        "properties": {
            "name": {"type": "string", "maxLength": 12, "title": "N"},
            "kind": {"type": "string", "const": "k"},
            "ref": {"$ref": "#/$defs/d"},
        },
        "$defs": {
            "d": {
                "type": "object",
                "properties": {"q": {"type": "string", "minLength": 2}},
                "required": ["q"],
            }
        },
    }
    body = {
        "model": "DeepSeek-V4.1-Flash",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": schema, "strict": True},
        },
    }
    converted = dr.ChatCompletionRequest(body).convert(dr.ConversionOptions())
    normalised = json.loads(converted.inference_options.output_constraint.schema)
    assert "maxLength" not in normalised["properties"]["name"] and "$defs" not in normalised
    kept = with_dropped_keywords(normalised, converted.conversation.response_schema)
    assert kept == {
        **schema,
        "additionalProperties": False,
        "$defs": {"d": {**schema["$defs"]["d"], "additionalProperties": False}},
    }
    accepts = matcher(kept)
    assert accepts('{"name":"abcdefghijkl","kind":"k","ref":{"q":"ab"}}')
    assert not accepts('{"name":"abcdefghijklm","kind":"k","ref":{"q":"ab"}}')
    assert not accepts('{"name":"a","kind":"x","ref":{"q":"ab"}}')
    assert not accepts('{"name":"a","kind":"k","ref":{"q":"a"}}')
    assert not accepts('{"name":"a","kind":"k","ref":{"q":"ab","z":1}}')
