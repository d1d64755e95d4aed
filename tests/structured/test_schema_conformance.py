"""The conformance suite over real-world schemas (the full run is `make
schema-conformance`): on a fixed sample of each source, nothing accepted up front is
refused by the engine, and every output that ends with EOS validates. Also the
validator it uses: strict JSON, jsonschema, RE2 for patterns."""

import pytest

from helpers import close_llm, make_llm
from tools.schema_conformance import (
    SCHEMA_DIR,
    conformance_error,
    refusal_class,
    run_suite,
    summary,
)

SAMPLE = {
    path.name
    for source in ("iglu-central", "schemastore")
    for path in sorted((SCHEMA_DIR / source).glob("*.json"))[::20]
}


@pytest.mark.engine
@pytest.mark.slow  # ~95 s; the default run keeps test_structured_outputs.py and the fuzz's
def test_sampled_real_world_schemas_conform_or_are_refused_up_front(tiny_checkpoint):
    assert len(SAMPLE) == 20, f"the vendored schemas are missing from {SCHEMA_DIR}"
    llm = make_llm(
        tiny_checkpoint,
        max_model_len=320,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
    )
    try:
        results = run_suite(llm, max_tokens=256, names=SAMPLE)
    finally:
        close_llm(llm)
    assert sorted(results) == ["iglu-central", "schemastore"]
    for source, counts in results.items():
        counted = summary(counts)
        assert counted["total"] == 10, source
        assert counts["engine_refused"] == [] and counts["invalid_outputs"] == [], counts
        assert counted["refused_up_front"] + counted["accepted"] == 10
        assert counted["stop_finished"] + counted["length_truncated"] == counted["accepted"]
    assert sum(summary(c)["accepted"] for c in results.values()) >= 10


@pytest.mark.unit
def test_a_hostile_pattern_is_matched_in_linear_time():
    """Python's `re` would backtrack for hours on this; RE2 answers at once."""
    schema = {"type": "string", "pattern": "^(a+)+$"}
    so_args = {"schema_type": "json", "schema": schema}
    assert conformance_error(so_args, '"' + "a" * 5000 + 'b"').startswith("violates")
    assert conformance_error(so_args, '"aaa"') is None
    keyed = {"type": "object", "patternProperties": {"^(a|aa)+$": {"type": "integer"}}}
    assert conformance_error(
        {"schema_type": "json", "schema": keyed}, '{"' + "a" * 3000 + '": "x"}'
    ).startswith("violates")


@pytest.mark.unit
@pytest.mark.parametrize(
    "reason,kind",
    [
        (
            "unsupported JSON Schema keyword 'oneOf' at $.a: its branches may overlap",
            "keyword oneOf",
        ),
        ("unsupported JSON Schema at $.x: The provided JSON schema ...", "vLLM request check"),
        ('invalid JSON Schema: Unsupported type "strin"', "xgrammar compile"),
    ],
)
def test_refusals_are_counted_by_reason(reason, kind):
    assert refusal_class(reason) == kind
