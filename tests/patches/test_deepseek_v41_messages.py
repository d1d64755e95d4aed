"""patches/deepseek_v41_messages: messages vLLM's V4.1 encoder cannot render are vLLM's
400 for `messages` with the encoder's reason (an AssertionError, a 500, upstream)."""

import pytest

from vllm_deepinfer.patches import deepseek_v41_messages

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer_module():
    assert deepseek_v41_messages.apply() is True
    from vllm.tokenizers import deepseek_v41

    return deepseek_v41


def test_a_developer_message_without_content_is_refused_with_the_encoders_reason(
    tokenizer_module,
):
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError) as refused:
        tokenizer_module.encode_messages(
            [{"role": "developer", "content": "", "name": ""}], thinking_mode="chat"
        )
    assert refused.value.parameter == "messages"
    assert "Invalid message for role `developer`" in str(refused.value)


def test_messages_it_can_render_are_rendered_as_before(tokenizer_module):
    import inspect

    original = inspect.unwrap(tokenizer_module.encode_messages)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    for mode in ("chat", "thinking"):
        assert tokenizer_module.encode_messages(messages, thinking_mode=mode) == original(
            messages, thinking_mode=mode
        )


def test_applying_again_wraps_once(tokenizer_module):
    wrapped = tokenizer_module.encode_messages
    assert deepseek_v41_messages.apply() is True
    assert tokenizer_module.encode_messages is wrapped


def test_not_needed_where_the_encoder_refuses_the_probe_itself(monkeypatch, tokenizer_module):
    monkeypatch.setattr(deepseek_v41_messages, "LEFT_TO_VLLM", "", raising=False)  # put back after

    def refusing(messages, **kwargs):
        raise ValueError("no")

    monkeypatch.setattr(tokenizer_module, "encode_messages", refusing)
    assert deepseek_v41_messages.apply() is False
    assert tokenizer_module.encode_messages is refusing
    assert "refuses" in deepseek_v41_messages.LEFT_TO_VLLM
