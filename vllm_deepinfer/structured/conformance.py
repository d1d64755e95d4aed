"""Whether an output satisfies its so_args constraint, strictly: JSON through strict
`json.loads` and `jsonschema`, regexes as a full match, EBNF accepted by its grammar."""
from __future__ import annotations

import json
import re

import xgrammar as xgr


def conformance_error(so_args: dict, text: str) -> str | None:
    """None when `text` satisfies the constraint, else what is wrong."""
    kind, schema = so_args["schema_type"], so_args["schema"]
    if kind == "json":
        import jsonschema

        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            return f"not strict JSON: {e}"
        try:
            jsonschema.validate(value, json.loads(schema) if isinstance(schema, str) else schema)
        except jsonschema.ValidationError as e:
            return f"violates the schema: {e.message}"
        return None
    if kind == "regex":
        return None if re.fullmatch(schema, text) else f"does not fully match /{schema}/"
    grammar = xgr.Grammar.from_ebnf(schema)
    # xgrammar's helper runs its matcher over the characters of a whole string.
    if not xgr.testing._is_grammar_accept_string(grammar, text):
        return "not accepted by the EBNF grammar"
    return None
