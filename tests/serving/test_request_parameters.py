"""Each request parameter of the three protocols that vLLM's engine can honour reaches it:
its effect is observed through a live server, on the random tiny model. Thinking is off
where it matters: in thinking mode the recipe fixes temperature and top_p (and top_k)
as the DeepSeek API does."""

import pytest
import requests

from helpers import NO_THINKING, SERVED_NAME

pytestmark = pytest.mark.server

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def z_id(api_server) -> int:
    """The id of the token `Z`, from vLLM's own /tokenize on the same server."""
    response = requests.post(
        f"{api_server}/tokenize",
        json={"model": SERVED_NAME, "prompt": "Z", "add_special_tokens": False},
        timeout=30,
    )
    [token_id] = response.json()["tokens"]
    return token_id


def chat(oa, max_tokens=8, extra_body=None, **request):
    """A no-thinking chat completion, greedy unless told otherwise."""
    request = {
        "model": SERVED_NAME,
        "messages": HELLO,
        "temperature": 0.0,
        "max_tokens": max_tokens,
        **request,
    }
    return oa.chat.completions.create(**request, extra_body={**NO_THINKING, **(extra_body or {})})


def test_max_completion_tokens_limits_the_answer(oa, z_id):
    """The limit OpenAI's client sends, preferred over max_tokens, as OpenAI does. The
    bias keeps the answer to whole one-token characters, which the recipe counts one
    each, and away from EOS."""
    bias = {str(z_id): 100}
    reply = chat(oa, max_tokens=None, max_completion_tokens=3, logit_bias=bias)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content == "ZZZ" and reply.usage.completion_tokens == 3
    both = chat(oa, max_tokens=12, max_completion_tokens=2, logit_bias=bias)
    assert both.choices[0].finish_reason == "length"
    assert both.choices[0].message.content == "ZZ" and both.usage.completion_tokens == 2


def test_max_completion_tokens_is_checked_against_the_context(api_server):
    body = {"model": SERVED_NAME, "messages": HELLO, "max_completion_tokens": 10**6, **NO_THINKING}
    response = requests.post(f"{api_server}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert "max_completion_tokens" in response.json()["error"]["message"]


def test_logit_bias_forces_a_token(oa, z_id):
    """+100 on one token makes it win every greedy step."""
    plain = chat(oa).choices[0].message.content
    biased = chat(oa, logit_bias={str(z_id): 100})
    assert plain != "Z" * 8
    assert biased.choices[0].message.content == "Z" * 8


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_penalties_break_repetition(oa, z_id, penalty):
    """A moderate bias makes greedy decoding repeat `Z`; a maximal penalty on tokens
    already generated makes it repeat less."""
    plain = chat(oa, logit_bias={str(z_id): 12}).choices[0].message.content
    penalised = chat(oa, logit_bias={str(z_id): 12}, **{penalty: 2.0})
    assert plain.count("Z") >= 4
    assert penalised.choices[0].message.content.count("Z") < plain.count("Z")


def message_text(claude, **sampling) -> str:
    """A no-thinking Messages reply; the anthropic client (2.x) no longer has sampling
    arguments, so they travel as extra body fields, as raw HTTP would send them."""
    reply = claude.messages.create(
        model=SERVED_NAME, max_tokens=12, messages=HELLO, extra_body={**NO_THINKING, **sampling}
    )
    return reply.content[0].text


@pytest.mark.parametrize("route", ["chat", "responses", "messages"])
def test_tiny_top_p_samples_the_most_likely_token(oa, claude, route):
    """top_p near 0 keeps only the most likely token: sampling at temperature 1 equals
    greedy decoding. Without top_p the same sampled request differs from it."""

    def run(**sampling):
        if route == "chat":
            return chat(oa, max_tokens=12, seed=3, **sampling).choices[0].message.content
        if route == "responses":
            return oa.responses.create(
                model=SERVED_NAME,
                input="Hello",
                max_output_tokens=12,
                reasoning={"effort": "none"},
                **sampling,
            ).output_text
        return message_text(claude, **sampling)

    greedy = run(temperature=0.0)
    assert run(temperature=1.0, top_p=1e-9) == greedy
    assert any(run(temperature=1.0) != greedy for _ in range(3))


def test_messages_top_k_one_is_greedy(claude):
    greedy = message_text(claude, temperature=0.0)
    assert message_text(claude, temperature=1.0, top_k=1) == greedy
    assert any(message_text(claude, temperature=1.0) != greedy for _ in range(3))


@pytest.mark.parametrize("route", ["chat", "responses", "messages"])
def test_seed_makes_sampling_repeatable(oa, claude, route):
    def run(seed):
        if route == "responses":  # vLLM's Responses takes `seed`; the recipe drops it
            return oa.responses.create(
                model=SERVED_NAME,
                input="Hello",
                max_output_tokens=12,
                reasoning={"effort": "none"},
                temperature=1.0,
                extra_body={"seed": seed},
            ).output_text
        if route == "messages":  # as Responses (Anthropic's API has no seed)
            return (
                claude.messages.create(
                    model=SERVED_NAME,
                    max_tokens=12,
                    messages=HELLO,
                    extra_body={**NO_THINKING, "temperature": 1.0, "seed": seed},
                )
                .content[0]
                .text
            )
        return chat(oa, max_tokens=12, temperature=1.0, seed=seed).choices[0].message.content

    first = run(7)
    assert run(7) == first
    assert any(run(seed) != first for seed in (8, 9, 10))


def test_seq_seed_is_the_seed(oa, claude):
    """DeepInfer's `seq_seed` names the same per-request seed on every route; a seed
    that disagrees with it is refused, naming both."""
    seeded = chat(oa, max_tokens=12, temperature=1.0, seed=7).choices[0].message.content
    aliased = chat(oa, max_tokens=12, temperature=1.0, extra_body={"seq_seed": 7})
    assert aliased.choices[0].message.content == seeded
    messages = [
        claude.messages.create(
            model=SERVED_NAME,
            max_tokens=12,
            messages=HELLO,
            extra_body={**NO_THINKING, "temperature": 1.0, "seq_seed": 11},
        )
        .content[0]
        .text
        for _ in range(2)
    ]
    assert messages[0] == messages[1]
    with pytest.raises(Exception) as refused:
        chat(oa, temperature=1.0, seed=7, extra_body={"seq_seed": 8})
    assert getattr(refused.value, "status_code", None) == 400
    assert "seq_seed" in str(refused.value) and "seed" in str(refused.value)


def test_messages_stop_sequences(claude):
    request = dict(
        model=SERVED_NAME,
        max_tokens=12,
        messages=HELLO,
        extra_body={**NO_THINKING, "temperature": 0.0},
    )
    text = claude.messages.create(**request).content[0].text
    stop = text[4:8]
    assert len(stop) == 4 and text.count(stop) == 1
    reply = claude.messages.create(**request, stop_sequences=[stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == text[: text.index(stop)]


def test_responses_top_logprobs(oa):
    reply = oa.responses.create(
        model=SERVED_NAME,
        input="Hello",
        max_output_tokens=4,
        reasoning={"effort": "none"},
        temperature=0.0,
        top_logprobs=3,
        include=["message.output_text.logprobs"],
    )
    logprobs = reply.output[-1].content[0].logprobs
    assert logprobs and all(len(entry.top_logprobs) == 3 for entry in logprobs)


def test_n_returns_that_many_choices(oa, z_id):
    sampled = chat(oa, max_tokens=6, temperature=1.0, seed=5, n=3)
    texts = [choice.message.content for choice in sampled.choices]
    assert [choice.index for choice in sampled.choices] == [0, 1, 2]
    assert len(set(texts)) > 1  # each choice samples on its own (vLLM: seed + index)
    forced = chat(oa, max_tokens=3, n=2, temperature=1.0, logit_bias={str(z_id): 100})
    assert [choice.message.content for choice in forced.choices] == ["ZZZ", "ZZZ"]
    assert all(choice.finish_reason == "length" for choice in forced.choices)
    assert forced.usage.completion_tokens == 6
    assert forced.usage.total_tokens == forced.usage.prompt_tokens + 6


def test_n_streams_each_choice_and_one_usage(oa):
    request = dict(
        model=SERVED_NAME,
        messages=HELLO,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        n=2,
        extra_body=NO_THINKING,
    )
    whole = oa.chat.completions.create(**request)
    chunks = list(
        oa.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    texts, finishes = ["", ""], [None, None]
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] += choice.delta.content or ""
        finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [choice.message.content for choice in whole.choices]
    assert finishes == [choice.finish_reason for choice in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_developer_role_is_a_system_message(oa):
    def prompt_tokens(role):
        messages = [{"role": role, "content": "Answer briefly."}, *HELLO]
        return chat(oa, max_tokens=1, messages=messages).usage.prompt_tokens

    assert prompt_tokens("developer") == prompt_tokens("system")


@pytest.mark.parametrize(
    "path,field,value",
    [
        ("/v1/chat/completions", "max_completion_tokens", "3"),
        ("/v1/chat/completions", "max_completion_tokens", 0),
        ("/v1/chat/completions", "logit_bias", {"x": 1}),
        ("/v1/chat/completions", "logit_bias", {"5": "high"}),
        ("/v1/chat/completions", "logit_bias", {"99999999": 1}),
        ("/v1/chat/completions", "frequency_penalty", 3),
        ("/v1/chat/completions", "presence_penalty", "a"),
        ("/v1/chat/completions", "top_p", 0),
        ("/v1/chat/completions", "n", 0),
        ("/v1/responses", "seed", "7"),
        ("/v1/chat/completions", "n", 1.5),
        ("/v1/responses", "top_p", "a"),
        ("/v1/messages", "top_k", "x"),
        ("/v1/messages", "top_k", -2),
    ],
)
def test_wrong_values_are_refused_naming_the_field(api_server, path, field, value):
    body = {"model": SERVED_NAME, "max_tokens": 4, **NO_THINKING, field: value, "messages": HELLO}
    response = requests.post(f"{api_server}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]
