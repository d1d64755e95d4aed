"""Strict `response_format` over HTTP: the protocol's strict normalisation (objects
closed) holds, and so do the user's keywords the recipe's normalisation drops (length
limits, const): the output obeys them and ends with EOS."""

import json

import pytest

from helpers import NO_THINKING, SERVED_NAME

pytestmark = pytest.mark.server

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "kind"],
    "properties": {
        "name": {"type": "string", "minLength": 3, "maxLength": 12},
        "kind": {"type": "string", "const": "fixed"},
    },
}


def check(content: str) -> None:
    value = json.loads(content)
    assert sorted(value) == ["kind", "name"] and value["kind"] == "fixed"
    assert 3 <= len(value["name"]) <= 12, value


def test_chat_strict_json_schema_keeps_the_users_limits(oa):
    reply = oa.chat.completions.create(
        model=SERVED_NAME,
        max_tokens=120,
        temperature=1.0,
        seed=3,
        extra_body=NO_THINKING,
        messages=[{"role": "user", "content": "Name a long river."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "river", "schema": SCHEMA, "strict": True},
        },
    )
    assert reply.choices[0].finish_reason == "stop"
    check(reply.choices[0].message.content)


def test_responses_strict_text_format_keeps_the_users_limits(oa):
    reply = oa.responses.create(
        model=SERVED_NAME,
        input="Name a long river.",
        max_output_tokens=120,
        temperature=1.0,
        reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "river", "schema": SCHEMA, "strict": True}},
    )
    assert reply.status == "completed"
    check(reply.output_text)
