"""patches/request_validators: vLLM's request models refuse, with its 400 naming the
field, the malformed bodies their before-validators crashed on (a 500 upstream)."""

import importlib
import sys

import pytest

from vllm_deepinfer.patches import request_validators

pytestmark = pytest.mark.unit

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def guarded():
    """The patch as the API server applies it (vLLM's app builder imported first)."""
    importlib.import_module(request_validators.APP_BUILDER)
    assert request_validators.apply() is True
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError

    return ChatCompletionRequest, CompletionRequest, VLLMValidationError


@pytest.mark.parametrize(
    "model,body,field,reason",
    [
        (1, request_validators._PROBE, "structured_outputs", "dictionary"),
        (0, {**CHAT, "structured_outputs": [1]}, "structured_outputs", "dictionary"),
        (
            0,
            {
                **CHAT,
                "tools": [{"type": "function"}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tools[0].function",
            "Field required",
        ),
    ],
)
def test_a_body_a_validator_crashed_on_is_refused_naming_the_field(
    guarded, model, body, field, reason
):
    request_model, refusal = guarded[model], guarded[2]
    with pytest.raises(refusal) as refused:
        request_model.model_validate(body)
    assert refused.value.parameter == field
    assert str(refused.value).startswith(f"{field}: ") and reason in str(refused.value)


def test_well_formed_bodies_and_vllms_own_refusals_are_unchanged(guarded):
    chat_request, completion_request, refusal = guarded
    assert chat_request.model_validate(CHAT).messages[0]["content"] == "hi"
    body = {"model": "m", "prompt": "p", "structured_outputs": {"regex": "a", "choice": ["b"]}}
    with pytest.raises(refusal, match="one kind of constraints"):  # vLLM's own check
        completion_request.model_validate(body)


def test_applying_again_changes_nothing(guarded):
    assert request_validators.apply() is True
    validators = request_validators._before_validators(guarded[0])
    assert all(getattr(d.func, request_validators._MARK, False) for d in validators.values())


def unguarded_probe(monkeypatch, upstream_crashes: bool) -> list:
    """The probed validator as upstream wrote it, and what `_models` was asked for."""
    probed = type("Decorator", (), {"func": staticmethod(lambda data: data)})()
    monkeypatch.setattr(
        request_validators,
        "_before_validators",
        lambda cls: {"check_structured_outputs_count": probed},
    )
    monkeypatch.setattr(request_validators, "_upstream_crashes", lambda cls: upstream_crashes)
    asked = []
    monkeypatch.setattr(request_validators, "_models", lambda base: asked.append(base) or [])
    return asked


def test_a_process_that_builds_no_http_app_is_left_alone(monkeypatch):
    """An engine core or a worker parses no request body: no model is rebuilt there."""
    asked = unguarded_probe(monkeypatch, upstream_crashes=True)
    monkeypatch.delitem(sys.modules, request_validators.APP_BUILDER, raising=False)
    assert request_validators.apply() is True and asked == []


def test_not_needed_where_vllm_refuses_the_probe_itself(monkeypatch):
    monkeypatch.setattr(request_validators, "LEFT_TO_VLLM", "", raising=False)  # put back after
    asked = unguarded_probe(monkeypatch, upstream_crashes=False)
    assert request_validators.apply() is False and asked == []
    assert "refuses" in request_validators.LEFT_TO_VLLM
