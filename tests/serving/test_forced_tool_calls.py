"""Forced tool calls: `tool_choice` required or a named function (Chat Completions,
Responses), `any` or `tool` (Messages) make the model emit the DSML tool-call markup, with
`｜DSML｜` as the special token and arguments valid under the tool's schema (see
vllm_deepinfer/serving/tool_choice.py).

Unit tests drive xgrammar's own matcher over the grammar with the tokenizer info vLLM
builds; server tests run the random tiny model, which only the grammar makes call a tool.
The schema keeps every value short (an enum, a bounded integer, a length-limited
string) so that greedy decoding closes the call well within max_tokens."""

import json

import anthropic
import deepseek_recipe as dr
import jsonschema
import openai
import pytest
import xgrammar as xgr

from fixtures import tokenizer as tiny_tokenizer
from helpers import NO_THINKING, SERVED_NAME
from vllm_deepinfer.serving.prompts import PromptEncoder
from vllm_deepinfer.serving.tool_choice import dsml_as_token, forced_tool_call
from vllm_deepinfer.structured.so_args import StructuredOutputError

WEATHER = {
    "type": "object",
    "required": ["city", "unit"],
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
}
TIME = {"type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}}}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
RESPONSES_TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "parameters": TIME},
]
MESSAGES_TOOLS = [
    {"name": "get_weather", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": TIME},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
MAX_TOKENS = 200
CALL = (
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="unit" string="true">celsius</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
)
CALLS_END = "</｜DSML｜ calls>"


def assert_valid_call(name: str, arguments: dict, forced: str | None = None) -> None:
    assert name == forced if forced else name in SCHEMAS
    jsonschema.validate(arguments, SCHEMAS[name])


# --- the grammar, through xgrammar's matcher -----------------------------------------------


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The tiny checkpoint's tokenizer: the recipe's encoder and xgrammar's tokenizer
    info built as vLLM's xgrammar backend builds it."""
    from vllm.tokenizers import get_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    (directory / "tokenizer.json").write_text(
        tiny_tokenizer.build_tokenizer_json(), encoding="utf-8"
    )
    (directory / "tokenizer_config.json").write_text(
        json.dumps(tiny_tokenizer.tokenizer_config(), ensure_ascii=False), encoding="utf-8"
    )
    info = xgr.TokenizerInfo.from_huggingface(
        get_tokenizer(str(directory)), vocab_size=tiny_tokenizer.VOCAB_SIZE
    )
    return PromptEncoder(str(directory)), xgr.GrammarCompiler(info, cache_enabled=True)


def constraint(tool_choice, protocol=dr.ChatCompletionRequest, tools=CHAT_TOOLS):
    body = {
        "model": "DeepSeek-V4.1-Flash",
        "messages": ASK,
        "tools": tools,
        "tool_choice": tool_choice,
        "max_tokens": 10,
        **NO_THINKING,
    }
    converted = protocol(json.dumps(body).encode()).convert(dr.ConversionOptions())
    return converted.inference_options.output_constraint


def matcher(tokenizers, tool_choice, body=None, **kwargs):
    body = body or {}
    encoder, compiler = tokenizers
    params = forced_tool_call(
        constraint(tool_choice, **kwargs),
        encoder.recipe_tokenizer,
        {"tool_choice": tool_choice, **body},
    )
    return xgr.GrammarMatcher(compiler.compile_structural_tag(params.structural_tag))


def accepts(tokenizers, tool_choice, *output: str, as_text: bool = False, **kwargs) -> bool:
    """Whether the grammar accepts the output and then the end of the answer. The pieces
    of `output` alternate: markup (special tokens as such), then text whose special
    spellings are plain text (as user text is encoded), ...; `as_text` makes all text."""
    encoder, _ = tokenizers
    grammar = matcher(tokenizers, tool_choice, **kwargs)
    ids = [
        i
        for n, piece in enumerate(output)
        for i in (encoder._plain if as_text or n % 2 else encoder._full)
        .encode(piece, add_special_tokens=False)
        .ids
    ]
    eos = encoder._full.token_to_id(dr.SpecialToken.Eos.default_str())
    return (
        all(grammar.accept_token(i) for i in ids)
        and grammar.accept_token(eos)
        and grammar.is_terminated()
    )


@pytest.mark.unit
def test_required_accepts_calls_of_any_listed_tool(tokenizers):
    time_call = (
        '<｜DSML｜ invoke name="get_time">\n<｜DSML｜ parameter name="zone" '
        'string="true">CET</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
    )
    assert accepts(tokenizers, "required", CALL + CALLS_END)
    assert accepts(tokenizers, "required", time_call + CALL + CALLS_END)


@pytest.mark.unit
@pytest.mark.parametrize(
    "output",
    [
        "Paris is sunny.",  # free text
        CALLS_END,  # no call
        CALL,  # the calls block left open
        CALL.replace("get_weather", "get_wetter") + CALLS_END,  # an unknown tool
        CALL.replace("celsius", "kelvin") + CALLS_END,  # not in the enum
        CALL.replace(">3<", ">9<") + CALLS_END,  # above the maximum
        CALL.replace("Paris", "Paris-sur-Seine") + CALLS_END,  # over maxLength
        CALL.replace(
            '<｜DSML｜ parameter name="unit" string="true">celsius</｜DSML｜ parameter>\n', ""
        )
        + CALLS_END,  # a required argument missing
    ],
)
def test_required_refuses_what_is_not_a_valid_call(tokenizers, output):
    assert not accepts(tokenizers, "required", output)


@pytest.mark.unit
def test_the_markup_must_be_the_special_token(tokenizers):
    """The recipe's parser reads markup only from the `｜DSML｜` token; the same characters
    as plain text would make a broken call."""
    assert not accepts(tokenizers, "required", CALL + CALLS_END, as_text=True)
    grammar = matcher(tokenizers, "required")
    encoder, _ = tokenizers
    [dsml] = encoder.recipe_tokenizer.encode("｜DSML｜")
    assert grammar.accept_token(encoder._full.token_to_id("<"))
    mask = xgr.allocate_token_bitmask(1, tiny_tokenizer.VOCAB_SIZE)
    grammar.fill_next_token_bitmask(mask)
    words = mask[0].tolist()
    allowed = [i for i in range(tiny_tokenizer.VOCAB_SIZE) if words[i // 32] >> (i % 32) & 1]
    assert allowed == [dsml]


@pytest.mark.unit
def test_string_values_cannot_hold_the_markup(tokenizers):
    """Free string values exclude `｜DSML｜`, as the token or as text (a string with a
    pattern, a length limit included, is matched by its pattern alone: see
    tool_choice.py)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "note",
                "parameters": {
                    "type": "object",
                    "required": ["text"],
                    "properties": {"text": {"type": "string"}},
                },
            },
        }
    ]
    before = '<｜DSML｜ invoke name="note">\n<｜DSML｜ parameter name="text" string="true">'
    after = "</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n" + CALLS_END
    assert accepts(tokenizers, "required", before, "a | b", after, tools=tools)
    assert not accepts(tokenizers, "required", before + "Pa｜DSML｜ris" + after, tools=tools)
    assert not accepts(tokenizers, "required", before, "Pa｜DSML｜ris", after, tools=tools)


@pytest.mark.unit
@pytest.mark.parametrize(
    "tool_choice, body, kwargs",
    [
        ("required", {"parallel_tool_calls": False}, {}),
        (
            {"type": "any", "disable_parallel_tool_use": True},
            {},
            dict(protocol=dr.MessagesRequest, tools=MESSAGES_TOOLS),
        ),
    ],
)
def test_parallel_calls_off_allows_one_call(tokenizers, tool_choice, body, kwargs):
    opening = "\n\n<｜DSML｜ calls>\n" if kwargs else ""
    assert accepts(tokenizers, tool_choice, opening + CALL + CALLS_END, body=body, **kwargs)
    assert not accepts(
        tokenizers, tool_choice, opening + CALL + CALL + CALLS_END, body=body, **kwargs
    )


@pytest.mark.unit
def test_a_named_function_is_the_only_one(tokenizers):
    named = {"type": "function", "function": {"name": "get_time"}}
    time_call = (
        '<｜DSML｜ invoke name="get_time">\n<｜DSML｜ parameter name="zone" '
        'string="true">UTC</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
    )
    assert accepts(tokenizers, named, time_call + CALLS_END)
    assert not accepts(tokenizers, named, CALL + CALLS_END)
    assert not accepts(tokenizers, named, time_call + time_call + CALLS_END)  # called once


@pytest.mark.unit
def test_messages_any_opens_the_calls_block_itself(tokenizers):
    """The recipe converts `any` to `auto` (its prompt does not open the block)."""
    kwargs = dict(protocol=dr.MessagesRequest, tools=MESSAGES_TOOLS)
    opened = "\n\n<｜DSML｜ calls>\n" + CALL + CALLS_END
    assert accepts(tokenizers, {"type": "any"}, opened, **kwargs)
    assert not accepts(tokenizers, {"type": "any"}, CALL + CALLS_END, **kwargs)
    assert not accepts(tokenizers, {"type": "any"}, "Sunny.", **kwargs)


@pytest.mark.unit
def test_auto_stays_unconstrained(tokenizers):
    encoder, _ = tokenizers
    assert (
        forced_tool_call(constraint("auto"), encoder.recipe_tokenizer, {"tool_choice": "auto"})
        is None
    )
    messages_auto = constraint({"type": "auto"}, dr.MessagesRequest, MESSAGES_TOOLS)
    assert (
        forced_tool_call(messages_auto, encoder.recipe_tokenizer, {"tool_choice": {"type": "auto"}})
        is None
    )


@pytest.mark.unit
def test_a_schema_that_cannot_be_enforced_is_refused_naming_the_tool(tokenizers):
    encoder, _ = tokenizers
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "q": {"type": "string", "format": "no-such-format", "maxLength": 3}
                    },
                },
            },
        }
    ]
    with pytest.raises(StructuredOutputError, match="tool 'lookup'"):
        forced_tool_call(constraint("required", tools=tools), encoder.recipe_tokenizer, {})


@pytest.mark.unit
def test_only_literals_outside_tag_dispatch_are_rewritten():
    ebnf = (
        'root ::= (("<\\uff5cDSML\\uff5c a" [\\"\\]] x "b\\"\\uff5cDSML\\uff5c"))\n'
        "x ::= TagDispatch(\n  loop_after_dispatch=false,\n"
        '  excludes=("\\uff5cDSML\\uff5c", "(")\n)\n'
    )
    rewritten = dsml_as_token(ebnf, 7)
    assert rewritten == ebnf.replace('"<\\uff5cDSML\\uff5c a"', '"<" Token(7) " a"').replace(
        '"b\\"\\uff5cDSML\\uff5c"', '"b\\"" Token(7)'
    )
    xgr.Grammar.from_ebnf(rewritten)


# --- through the server --------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize(
    "tool_choice, forced",
    [("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")],
)
def test_chat_forced_call(oa, tool_choice, forced):
    """One call (a named function, or parallel calls off: the random model, left to
    itself, goes on calling tools until max_tokens)."""
    reply = oa.chat.completions.create(
        model=SERVED_NAME,
        messages=ASK,
        tools=CHAT_TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body=NO_THINKING,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert_valid_call(call.function.name, json.loads(call.function.arguments), forced)


@pytest.mark.server
def test_chat_forced_call_streamed(oa):
    stream = oa.chat.completions.create(
        model=SERVED_NAME,
        messages=ASK,
        tools=CHAT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        extra_body=NO_THINKING,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0]
    assert_valid_call(calls[0]["name"], json.loads(calls[0]["arguments"]))


@pytest.mark.server
@pytest.mark.parametrize(
    "tool_choice, forced",
    [("required", None), ({"type": "function", "name": "get_weather"}, "get_weather")],
)
def test_responses_forced_call(oa, tool_choice, forced):
    reply = oa.responses.create(
        model=SERVED_NAME,
        input="Weather in Paris?",
        tools=RESPONSES_TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_output_tokens=MAX_TOKENS,
        temperature=0.0,
        reasoning={"effort": "none"},
    )
    [call] = [item for item in reply.output if item.type == "function_call"]
    assert reply.status == "completed"
    assert_valid_call(call.name, json.loads(call.arguments), forced)


@pytest.mark.server
@pytest.mark.parametrize(
    "tool_choice, forced",
    [
        ({"type": "any", "disable_parallel_tool_use": True}, None),
        ({"type": "tool", "name": "get_time"}, "get_time"),
    ],
)
def test_messages_forced_call(claude, tool_choice, forced):
    reply = claude.messages.create(
        model=SERVED_NAME,
        max_tokens=MAX_TOKENS,
        messages=ASK,
        tools=MESSAGES_TOOLS,
        tool_choice=tool_choice,
        extra_body={**NO_THINKING, "temperature": 0.0},
    )
    [use] = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use"
    assert_valid_call(use.name, use.input, forced)


@pytest.mark.server
def test_forced_call_round_trip(oa):
    """The forced call goes back into the history with its result, and the next turn
    (tool_choice auto) answers after it."""
    first = oa.chat.completions.create(
        model=SERVED_NAME,
        messages=ASK,
        tools=CHAT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body=NO_THINKING,
    )
    [call] = first.choices[0].message.tool_calls
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = oa.chat.completions.create(
        model=SERVED_NAME,
        messages=history,
        tools=CHAT_TOOLS,
        max_tokens=8,
        temperature=0.0,
        extra_body=NO_THINKING,
    )
    assert second.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.server
@pytest.mark.parametrize("route", ["chat", "responses", "messages"])
def test_forced_calls_in_thinking_mode_are_refused(oa, claude, route):
    """As the official DeepSeek API (and the recipe) does: a forced choice is a 400 in
    thinking mode, the default, not a 200 without a call."""
    error = anthropic.BadRequestError if route == "messages" else openai.BadRequestError
    with pytest.raises(error, match="Thinking mode does not support this tool_choice"):
        if route == "chat":
            oa.chat.completions.create(
                model=SERVED_NAME,
                messages=ASK,
                tools=CHAT_TOOLS,
                tool_choice="required",
                max_tokens=8,
            )
        elif route == "responses":
            oa.responses.create(
                model=SERVED_NAME,
                input="Hi",
                tools=RESPONSES_TOOLS,
                tool_choice="required",
                max_output_tokens=8,
            )
        else:
            claude.messages.create(
                model=SERVED_NAME,
                max_tokens=8,
                messages=ASK,
                tools=MESSAGES_TOOLS,
                tool_choice={"type": "tool", "name": "get_time"},
            )
