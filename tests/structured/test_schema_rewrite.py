"""The strict JSON-Schema rewrite, checked with xgrammar's own matcher on grammars compiled
the way vLLM's engine compiles them (the checkpoint's tokenizer, caching on, no free
whitespace): length limits of any size, strings wherever they sit, required names that
`properties` does not list, and schemas vLLM would refuse refused up front."""
import json
import re

import pytest
import xgrammar as xgr

from vllm_deepinfer.structured.so_args import (MAX_REPEAT, StructuredOutputError,
                                               strict_json_schema, to_structured_outputs)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def compiler(tiny_checkpoint):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{tiny_checkpoint}/tokenizer.json")
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer),
                                             stop_token_ids=[tokenizer.convert_tokens_to_ids(
                                                 "<｜end▁of▁sentence｜>")])
    return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)


def accepts(compiler, schema: dict, text: str) -> bool:
    """Compiled as vLLM's xgrammar backend compiles with disable_any_whitespace."""
    compiled = compiler.compile_json_schema(json.dumps(strict_json_schema(schema)),
                                            any_whitespace=False, separators=(",", ":"))
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


def string_value(n: int, char: str = "a") -> str:
    return json.dumps(char * n)


@pytest.mark.parametrize("low,high", [(0, 4), (0, 255), (130, 300), (256, 256), (5, None)])
def test_length_limits_of_any_size(compiler, low, high):
    schema = {"type": "string", "minLength": low}
    if high is not None:
        schema["maxLength"] = high
    top = high if high is not None else low + 300
    for n in sorted({low, top, (low + top) // 2, MAX_REPEAT, MAX_REPEAT + 1, 2 * MAX_REPEAT}):
        assert accepts(compiler, schema, string_value(n)) == (low <= n <= top), n
    if low:
        assert not accepts(compiler, schema, string_value(low - 1))
    if high is not None:
        assert not accepts(compiler, schema, string_value(high + 1))
    assert not accepts(compiler, schema, '"' + "a" * low + "\x01" + '"')


@pytest.mark.parametrize("schema,where", [
    ({"type": ["string", "null"], "maxLength": 150}, lambda s: s),
    ({"anyOf": [{"type": "string", "maxLength": 150}, {"type": "integer"}]}, lambda s: s),
    ({"type": "array", "items": {"type": "string", "maxLength": 150}}, lambda s: f"[{s}]"),
    ({"type": "array", "prefixItems": [{"type": "string", "maxLength": 150}]}, lambda s: f"[{s}]"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 150}},
      "required": ["a"]}, lambda s: f'{{"a":{s}}}'),
    ({"type": "object", "additionalProperties": {"type": "string", "maxLength": 150}},
     lambda s: f'{{"k":{s}}}'),
    ({"$defs": {"name": {"type": "string", "maxLength": 150}}, "type": "object",
      "properties": {"n": {"$ref": "#/$defs/name"}}, "required": ["n"]},
     lambda s: f'{{"n":{s}}}'),
])
def test_strings_wherever_they_sit(compiler, schema, where):
    assert accepts(compiler, schema, where(string_value(150)))
    assert not accepts(compiler, schema, where('"a\x01b"'))
    assert not accepts(compiler, schema, where(string_value(151)))


def test_type_list_keeps_its_other_types(compiler):
    schema = {"type": ["string", "null"], "maxLength": 3}
    assert accepts(compiler, schema, "null")
    assert accepts(compiler, schema, '"abc"')
    assert not accepts(compiler, schema, '"abcd"')


def test_required_names_missing_from_properties_are_enforced(compiler):
    schema = {"type": "object", "properties": {}, "required": ["top"]}
    assert not accepts(compiler, schema, "{}")
    assert accepts(compiler, schema, '{"top":1}')
    bare = {"type": "object", "required": ["a", "b"]}
    assert not accepts(compiler, bare, '{"a":1}')
    assert accepts(compiler, bare, '{"a":1,"b":"x"}')


@pytest.mark.parametrize("schema,path", [
    ({"type": "object", "properties": {"d": {"type": "string", "format": "email",
                                             "maxLength": 9}}}, "$.properties.d"),
    ({"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}},
     "$.properties.x"),
    ({"type": "number", "multipleOf": 3}, "$"),
])
def test_what_vllm_would_refuse_is_refused_up_front(schema, path):
    with pytest.raises(StructuredOutputError,
                       match=rf"unsupported JSON Schema at {re.escape(path)}: "):
        to_structured_outputs({"schema_type": "json", "schema": schema})


def test_bad_length_limits_are_refused():
    with pytest.raises(StructuredOutputError, match="invalid string length limits"):
        to_structured_outputs({"schema_type": "json",
                               "schema": {"type": "string", "minLength": 5, "maxLength": 2}})
