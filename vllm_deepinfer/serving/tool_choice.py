"""Forced tool calls (`tool_choice` required or a named function; Messages `any` or `tool`)
as a grammar over DeepSeek V4.1's DSML tool-call markup:

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

`｜DSML｜` is one special token, and the recipe's parser takes markup only from that
token: the same characters spelled as plain text are text. xgrammar, with the tokenizer
info vLLM builds, sees the token as an ordinary one whose bytes are `｜DSML｜`, so a
grammar over text would also admit the plain-text spelling. The grammar is therefore
xgrammar's own V4.1 argument grammar (`deepseek_v4_1_xml`: the parameters, string values
raw, the others JSON, checked against the tool's schema) compiled to EBNF, with every
`｜DSML｜` in its markup (the style writes its parameter markup as text, with no way to
ask for the token) replaced by the token itself (`Token(id)`) and `｜DSML｜` barred from
free string values.

The EBNF goes to vLLM as a structural tag (its grammar format), not as a grammar: vLLM
0.33 compiles grammars, JSON, regex and choices over a vocabulary with every special token
blanked, where `Token(id)` of `｜DSML｜` can never be generated; structural tags it
compiles over the full vocabulary, as 0.32 compiles everything.

For required / named choices the recipe's prompt already opens the calls block (and the
recipe refuses them in thinking mode); Messages `any` the recipe converts to `auto`,
so there the grammar opens the block itself, after the thinking part when thinking is on
(vLLM applies a grammar after `</think>` under `--reasoning-parser deepseek_v41`).
"""

from __future__ import annotations

import functools
import json
import re

import deepseek_recipe as dr
import xgrammar as xgr
from vllm.sampling_params import StructuredOutputsParams
from xgrammar.structural_tag import (
    ConstStringFormat,
    GrammarFormat,
    JSONSchemaFormat,
    OrFormat,
    PlusFormat,
    SequenceFormat,
    StructuralTag,
    TokenFormat,
)

from vllm_deepinfer.structured.so_args import StructuredOutputError, checked_json_schema

DSML = dr.SpecialToken.Dsml.default_str()
CALLS_OPENING = "\n\n<" + DSML + " calls>\n"
"""What the recipe's prompt ends with for a required / named choice (after `</think>`)."""
MAX_WHITESPACE = 2
"""Consecutive whitespace between and inside the arguments (the recipe writes one newline
between parameters and compact JSON): a model can't stall on blank lines."""
_GRAMMAR_PIECE = re.compile(  # a literal, a character class, a TagDispatch, ( ) or the rest
    r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|TagDispatch\(|[()]|[^"\[()T]+|T'
)
_ESCAPE_UNIT = re.compile(r"\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}|\\x[0-9a-fA-F]{2}|\\.|.", re.S)


def forced_tool_call(constraint, tokenizer, body: dict) -> StructuredOutputsParams | None:
    """The grammar for the recipe's `tool_call` / `tool_call_required` constraint when a
    call is forced; None when the model may answer in text (`auto`). `tokenizer` is the
    recipe's; `body` the request's JSON fields, for what the constraint does not carry:
    Messages `{"type": "any"}` (which the recipe converts to `auto`), a named choice, and
    `parallel_tool_calls: false` / `disable_parallel_tool_use` (one call). Raises
    StructuredOutputError, naming the tool, where the call cannot be enforced."""
    tool_choice = body.get("tool_choice")
    if constraint.kind == "tool_call_required":
        opening = ""  # the prompt opened the calls block
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "any":
        opening = CALLS_OPENING
    else:
        return None
    ids = tokenizer.encode(DSML)
    if len(ids) != 1:
        raise StructuredOutputError(
            f"tool_choice cannot be enforced: the tokenizer has no single {DSML} token"
        )
    dsml_id = ids[0]
    invokes = [_invoke(tool["function"], dsml_id) for tool in json.loads(constraint.schema)]
    if not invokes:
        raise StructuredOutputError("tool_choice forces a tool call, but no tool is given")
    invoke = OrFormat(elements=invokes)
    calls = SequenceFormat(
        elements=[
            *([ConstStringFormat(value=opening)] if opening else []),
            invoke if _one_call(body) else PlusFormat(content=invoke),
            *_markup("</", dsml_id, " calls>"),
        ]
    )
    ebnf = str(xgr.Grammar.from_structural_tag(StructuralTag(format=calls).model_dump_json()))
    grammar = GrammarFormat(grammar=dsml_as_token(ebnf, dsml_id))
    return StructuredOutputsParams(structural_tag=StructuralTag(format=grammar).model_dump_json())


def _one_call(body: dict) -> bool:
    """A named function is called once (as OpenAI and vLLM do), and so is any tool where
    the request turns parallel calls off; otherwise one or more calls."""
    tool_choice = body.get("tool_choice")
    if isinstance(tool_choice, dict) and (
        tool_choice.get("type") in ("function", "tool")
        or tool_choice.get("disable_parallel_tool_use")
    ):
        return True
    return body.get("parallel_tool_calls") is False


def _invoke(function: dict, dsml_id: int) -> SequenceFormat:
    """One call of `function`, its arguments valid under its parameters schema (through
    the same checks as every JSON constraint)."""
    name = function["name"]
    try:
        schema = checked_json_schema(function.get("parameters") or {"type": "object"})
    except StructuredOutputError as e:
        raise StructuredOutputError(f"tool_choice cannot be enforced for tool {name!r}: {e}") from e
    arguments = JSONSchemaFormat(
        json_schema=schema,
        style="deepseek_v4_1_xml",
        excludes=[DSML],
        max_whitespace_cnt=MAX_WHITESPACE,
    )
    return SequenceFormat(
        elements=[
            *_markup("<", dsml_id, f' invoke name="{name}">\n'),
            arguments,
            *_markup("</", dsml_id, " invoke>\n"),
        ]
    )


def _markup(before: str, dsml_id: int, after: str) -> list:
    return [
        ConstStringFormat(value=before),
        TokenFormat(token=dsml_id),
        ConstStringFormat(value=after),
    ]


def dsml_as_token(ebnf: str, dsml_id: int) -> str:
    """The EBNF with each string literal's `｜DSML｜` replaced by `Token(dsml_id)`, except
    inside `TagDispatch(...)`, whose excluded strings stay text."""
    scanned = _GRAMMAR_PIECE.findall(ebnf)
    if sum(map(len, scanned)) != len(ebnf):
        raise StructuredOutputError(
            "tool_choice cannot be enforced: the tool-call grammar "
            "has a literal this rewrite does not read"
        )
    pieces, depth = [], 0  # depth: open parentheses of a TagDispatch
    for piece in scanned:
        if piece == "TagDispatch(" or (depth and piece == "("):
            depth += 1
        elif depth and piece == ")":
            depth -= 1
        elif not depth and piece.startswith('"'):
            piece = _split_literal(piece, dsml_id)
        pieces.append(piece)
    return "".join(pieces)


def _split_literal(literal: str, dsml_id: int) -> str:
    units = _ESCAPE_UNIT.findall(literal[1:-1])
    marker = _printed_dsml_units()
    parts, start, i = [], 0, 0
    while i <= len(units) - len(marker):
        if units[i : i + len(marker)] == marker:
            parts += [_literal(units[start:i]), f"Token({dsml_id})"]
            i = start = i + len(marker)
        else:
            i += 1
    if not parts:
        return literal
    parts.append(_literal(units[start:]))
    return " ".join(part for part in parts if part)


def _literal(units: list[str]) -> str:
    return f'"{"".join(units)}"' if units else ""


@functools.cache
def _printed_dsml_units() -> list[str]:
    """`｜DSML｜` as xgrammar prints it inside a literal (escape by escape)."""
    printed = str(xgr.Grammar.from_ebnf(f'root ::= "{DSML}"'))
    return _ESCAPE_UNIT.findall(re.search(r'"(.*)"', printed).group(1))
