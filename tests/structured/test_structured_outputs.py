"""DeepInfer's so_args: validated before the engine, mapped onto vLLM's xgrammar backend,
and every output conforms strictly (json.loads + jsonschema, full regex match, EBNF
parse) and ends with EOS."""

import json
import re

import pytest
import xgrammar as xgr

from helpers import close_llm, make_llm
from tools.schema_conformance import conformance_error
from vllm_deepinfer.structured.so_args import (
    StructuredOutputError,
    json_grammar,
    sampling_params,
    to_structured_outputs,
)

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Hangzhou", "Lima"]},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "tags", "address"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
            "level": {"type": "string", "enum": ["low", "mid", "high"]},
        },
        "required": ["ok", "score", "level"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
]
REGEXES = [r"(yes|no), [0-9]{2}", r"[a-z]{3,6}@[a-z]{2,5}\.(com|org)"]
EBNF = [
    'root ::= "(" expr ")"\nexpr ::= term ("+" term)*\nterm ::= [0-9] | "(" expr ")"',
    'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z]+',
]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    """JSON without free whitespace: a random model otherwise pads between tokens until
    the length limit instead of closing the object."""
    llm = make_llm(
        tiny_checkpoint,
        max_num_seqs=16,
        structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
    )
    yield llm
    close_llm(llm)


@pytest.mark.engine
def test_mixed_constraints_in_one_batch_conform_and_stop(llm):
    from vllm.inputs import TokensPrompt

    cases = (
        [("json", s) for s in SCHEMAS]
        + [("regex", r) for r in REGEXES]
        + [("ebnf", g) for g in EBNF]
    )
    params = [
        sampling_params(
            so_args={"schema_type": kind, "schema": schema}, max_tokens=200, temperature=0.0
        )
        for kind, schema in cases
    ]
    prompts = [TokensPrompt(prompt_token_ids=list(range(3 + i, 40 + i))) for i in range(len(cases))]
    outputs = llm.generate(prompts, params)
    for (kind, schema), output in zip(cases, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (kind, schema, completion.text)
        so_args = {"schema_type": kind, "schema": schema}
        assert conformance_error(so_args, completion.text) is None, (so_args, completion.text)


@pytest.mark.unit
@pytest.mark.parametrize(
    "so_args,text,expected",
    [
        ({"schema_type": "json", "schema": SCHEMAS[2]}, "[1, 5]", None),
        ({"schema_type": "json", "schema": SCHEMAS[2]}, "[1, 50]", "violates the schema"),
        (
            {"schema_type": "json", "schema": SCHEMAS[1]},
            '{"ok": true, "s": "a\x01"}',
            "not strict JSON",
        ),
        ({"schema_type": "regex", "schema": REGEXES[0]}, "yes, 42!", "does not fully match"),
        ({"schema_type": "ebnf", "schema": EBNF[0]}, "(1+(2+3))", None),
        ({"schema_type": "ebnf", "schema": EBNF[0]}, "(1+)", "not accepted"),
    ],
)
def test_conformance_checks_can_fail(so_args, text, expected):
    error = conformance_error(so_args, text)
    assert error is None if expected is None else expected in error


@pytest.mark.unit
def test_length_limited_strings_exclude_control_characters():
    """xgrammar 0.2.8 lets a raw control character into a maxLength string; the grammar
    the engine gets does not, and keeps the length limits."""
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 4}},
        "required": ["s"],
    }
    bad, good, too_long = '{"s": "a\x01b"}', '{"s": "abcd"}', '{"s": "abcde"}'
    raw = xgr.Grammar.from_json_schema(json.dumps(schema))
    assert xgr.testing._is_grammar_accept_string(raw, bad)
    grammar = xgr.Grammar.from_ebnf(json_grammar(schema))
    compact = [text.replace(": ", ":") for text in (bad, good, too_long)]
    assert not xgr.testing._is_grammar_accept_string(grammar, compact[0])
    assert xgr.testing._is_grammar_accept_string(grammar, compact[1])
    assert not xgr.testing._is_grammar_accept_string(grammar, compact[2])


@pytest.mark.unit
@pytest.mark.parametrize(
    "so_args,message",
    [
        (
            {"schema_type": "json", "schema": '{"type": "strin"}'},
            'invalid JSON Schema: Unsupported type "strin"',
        ),
        ({"schema_type": "json", "schema": "{oops"}, "so_args schema is not valid JSON"),
        ({"schema_type": "json", "schema": [1, 2]}, "must be a JSON Schema object"),
        (
            {"schema_type": "regex", "schema": "a(b"},
            "invalid regex: Regex parsing error at position 4",
        ),
        (
            {"schema_type": "ebnf", "schema": 'root ::= "a" |'},
            "invalid EBNF grammar: EBNF parser error",
        ),
        ({"schema_type": "xml", "schema": "<a/>"}, "schema_type must be one of"),
        ({"schema_type": "regex"}, "so_args needs a schema"),
        ({"schema_type": "regex", "schema": "a", "strict": True}, "unknown fields ['strict']"),
        ("json", "so_args must be an object"),
    ],
)
def test_bad_constraints_are_rejected_before_the_engine(so_args, message):
    with pytest.raises(StructuredOutputError) as error:
        to_structured_outputs(so_args)
    assert message in str(error.value)


@pytest.mark.engine
def test_engine_keeps_serving_after_a_rejected_constraint(llm):
    from vllm.inputs import TokensPrompt

    with pytest.raises(StructuredOutputError):
        sampling_params(so_args={"schema_type": "regex", "schema": "(("}, max_tokens=8)
    params = sampling_params(
        so_args={"schema_type": "regex", "schema": "[0-9]{3}"}, max_tokens=8, temperature=0.0
    )
    output = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], params)[0].outputs[0]
    assert re.fullmatch("[0-9]{3}", output.text) and output.finish_reason == "stop"


@pytest.mark.engine
@pytest.mark.slow  # a fresh process; the constraints it checks are checked in-process above
def test_offline_example_checks_structured_output(tiny_checkpoint):
    """The example's --check_structured_output run passes on the embedded checkpoint."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).parents[2] / "examples" / "offline_inference.py"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    # Eager: compiling (tests/examples/test_offline_demo.py) is not what this checks.
    run = subprocess.run(
        [
            sys.executable,
            str(example),
            "--model",
            tiny_checkpoint,
            "--check_structured_output",
            "--enforce-eager",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    checks = [line for line in run.stdout.splitlines() if line[:4] in ("OK  ", "FAIL")]
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert len(checks) == 3 and all(line.startswith("OK") for line in checks)


@pytest.mark.engine
def test_grammars_compiled_outside_the_engine_are_not_compiled_again(llm):
    """The compile pool (its own process) compiles and caches; the engine's xgrammar
    backend then deserializes the grammar instead of compiling it."""
    import uuid

    from vllm.inputs import TokensPrompt

    from vllm_deepinfer import envs
    from vllm_deepinfer.structured.compile_pool import GrammarCompilePool

    engine = llm.llm_engine.engine_core.engine_core
    fresh = f"(ok|no)-{uuid.uuid4().hex[:8]}"  # never compiled before in this session
    params = [
        sampling_params(
            so_args={"schema_type": "regex", "schema": fresh}, max_tokens=20, temperature=0.0
        )
    ]
    pool = GrammarCompilePool(llm.llm_engine.vllm_config, envs.load().grammar_cache_dir)
    try:
        (first,) = pool.compile_all(params)
        (again,) = pool.compile_all(params)
    finally:
        pool.shutdown()
    assert not first.cached and again.cached

    def engine_compiler_stats():
        backend = engine.structured_output_manager.backend  # made at the first constraint
        return (
            (0, 0)
            if backend is None
            else (backend.compiler.stats.compiles, backend.compiler.stats.hits)
        )

    compiles, hits = engine_compiler_stats()
    output = llm.generate([TokensPrompt(prompt_token_ids=[9, 8, 7])], params)[0].outputs[0]
    assert re.fullmatch(fresh, output.text) and output.finish_reason == "stop"
    assert engine_compiler_stats() == (compiles, hits + 1)


@pytest.mark.engine
def test_a_batch_is_compiled_as_its_engine_compiles_before_generate(llm):
    """engine_compiled: the engine's own xgrammar backend and tokenizer, offline; a long
    length limit compiles and holds in the output, with no raw control character."""
    from vllm.inputs import TokensPrompt

    from vllm_deepinfer.structured.so_args import engine_compiled

    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 130, "maxLength": 300}},
        "required": ["s"],
        "additionalProperties": False,
    }
    params = sampling_params(
        so_args={"schema_type": "json", "schema": schema}, max_tokens=400, temperature=1.0, seed=2
    )
    engine_compiled(llm, [params])
    output = llm.generate([TokensPrompt(prompt_token_ids=[4, 5, 6])], params)[0].outputs[0]
    assert output.finish_reason == "stop", output.text
    assert conformance_error({"schema_type": "json", "schema": schema}, output.text) is None
