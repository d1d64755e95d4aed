"""Prompts reach the engine injection-safe, and parallel tokenization changes nothing.

Every special token of the tokenizer is written into every role of every protocol, at
the start, middle and end of a message; the ids the service hands to the engine must
hold exactly the template's special ids, the same as for harmless text.

One deliberate exception, deepseek-recipe's: in the assistant's own earlier turns the
visual-grounding markup (ref/box/point/polygon) is the model's output format and is
replayed as such. Text from users, system prompts and tool results never is."""

import json
import random

import pytest

from fixtures.tokenizer import _CORPUS, SPECIAL_TOKENS
from vllm_deepinfer.serving.chat_service import ApiError, ChatService
from vllm_deepinfer.serving.prompts import PARALLEL_MIN_CHARS, PromptEncoder
from vllm_deepinfer.serving.protocols import CHAT, MESSAGES, RESPONSES

pytestmark = pytest.mark.unit

SPECIAL_IDS = {token_id for _, token_id in SPECIAL_TOKENS}
ROLES = ("system", "user", "assistant", "tool")
POSITIONS = {"start": "{s}plain text", "middle": "plain{s} text", "end": "plain text{s}"}
GROUNDING = {
    "<｜ref｜>",
    "<｜/ref｜>",
    "<｜box｜>",
    "<｜/box｜>",
    "<｜point｜>",
    "<｜/point｜>",
    "<｜polygon｜>",
    "<｜/polygon｜>",
}


def chat_body(texts):
    return {
        "model": "tiny",
        "tools": [
            {
                "type": "function",
                "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
            }
        ],
        "messages": [
            {"role": "system", "content": texts["system"]},
            {"role": "user", "content": texts["user"]},
            {
                "role": "assistant",
                "content": texts["assistant"],
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": "{}"},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": texts["tool"]},
            {"role": "user", "content": "thanks"},
        ],
    }


def responses_body(texts):
    return {
        "model": "tiny",
        "instructions": texts["system"],
        "tools": [
            {
                "type": "function",
                "name": "lookup",
                "parameters": {"type": "object", "properties": {}},
            }
        ],
        "input": [
            {"role": "user", "content": texts["user"]},
            {"role": "assistant", "content": texts["assistant"]},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": texts["tool"]},
            {"role": "user", "content": "thanks"},
        ],
    }


def messages_body(texts):
    return {
        "model": "tiny",
        "max_tokens": 16,
        "system": texts["system"],
        "tools": [{"name": "lookup", "input_schema": {"type": "object", "properties": {}}}],
        "messages": [
            {"role": "user", "content": texts["user"]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": texts["assistant"]},
                    {"type": "tool_use", "id": "c1", "name": "lookup", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "c1", "content": texts["tool"]}],
            },
            {"role": "user", "content": "thanks"},
        ],
    }


PROTOCOLS = {
    "chat": (CHAT, chat_body),
    "responses": (RESPONSES, responses_body),
    "messages": (MESSAGES, messages_body),
}


@pytest.fixture(scope="module")
def service(tiny_checkpoint):
    """The service's request preparation: what it returns is what goes to the engine."""
    return ChatService(None, PromptEncoder(tiny_checkpoint), ["tiny"], 1_000_000)


def prompt_ids(service, protocol, body):
    return service.prepare(protocol, json.dumps(body).encode(), "application/json").prompt_ids


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("protocol_name", PROTOCOLS)
def test_special_token_spellings_in_messages_stay_text(service, protocol_name, role, position):
    protocol, make_body = PROTOCOLS[protocol_name]
    harmless = {r: f"{r} says hello" for r in ROLES}
    expected = [i for i in prompt_ids(service, protocol, make_body(harmless)) if i in SPECIAL_IDS]
    for spelling, _ in SPECIAL_TOKENS:
        if role == "assistant" and spelling in GROUNDING:
            continue
        texts = dict(harmless, **{role: POSITIONS[position].format(s=spelling)})
        ids = prompt_ids(service, protocol, make_body(texts))
        assert [i for i in ids if i in SPECIAL_IDS] == expected, spelling
        decoded = service.encoder._full.decode(ids, skip_special_tokens=False)
        assert spelling in decoded  # the spelling arrives, as plain text


def random_text(rng, words):
    return " ".join(rng.choice(words) for _ in range(rng.randint(20_000, 30_000)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parallel_tokenization_equals_sequential(service, seed):
    rng = random.Random(seed)
    words = _CORPUS.split() + [s for s, _ in SPECIAL_TOKENS] + ["  ", "\n\n", "\t", " x ", "🙂"]
    texts = {r: random_text(rng, words) for r in ROLES}
    body = chat_body(texts)
    converted = service.prepare(CHAT, json.dumps(body).encode(), "application/json").converted
    rendered = service.encoder.encoding.render_conversation(converted.conversation)
    assert len(rendered.prompt) > 100_000 > PARALLEL_MIN_CHARS
    sequential = service.encoder.encode_sequential(converted.conversation)
    assert service.encoder.encode(converted.conversation) == sequential
    assert service.encoder.encode_rendered(rendered.prompt, rendered.special_ranges) == sequential


def test_short_text_split_into_pieces_encodes_the_same(service):
    """Cut points fall at pre-token boundaries, also inside runs of spaces and CJK."""
    text = "word  word\t\tx   y\n\n\nz 你好，世界。" * 800
    pieces = service.encoder._pieces(text)
    assert len(pieces) > 1 and "".join(pieces) == text
    assert (
        service.encoder.encode_rendered(text, [])
        == service.encoder._plain.encode(text, add_special_tokens=False).ids
    )


@pytest.mark.parametrize("protocol_name", PROTOCOLS)
@pytest.mark.parametrize(
    "body,content_type,status,message",
    [
        (b'{"model": "tiny", "messages": [', "application/json", 400, "invalid JSON"),
        (b'{"model": "tiny"}', "text/plain", 415, "Content-Type must be application/json"),
        (b'{"messages": []}', "application/json", 400, "missing field `model`"),
        (b'{"model": 5, "messages": []}', "application/json", 400, "invalid type"),
        (
            b'{"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}',
            "application/json",
            404,
            "The model `gpt-4` does not exist",
        ),
    ],
)
def test_malformed_requests_are_refused(
    service, protocol_name, body, content_type, status, message
):
    protocol, _ = PROTOCOLS[protocol_name]
    with pytest.raises(ApiError) as error:
        service.prepare(protocol, body, content_type)
    assert error.value.status == status and message in error.value.message
