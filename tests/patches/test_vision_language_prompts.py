"""The vision-language prompts patch: a vision checkpoint's model config defaults to
vLLM's V4.1 encoder, and the encoder's image placeholder is respelled as the checkpoint's
tokenizer spells the image token."""

import pytest

from vllm_deepinfer.model.deepseek_v41.args import IMAGE_TOKEN_ID
from vllm_deepinfer.model.deepseek_v41.registration import ARCH, VL_ARCH
from vllm_deepinfer.patches import vision_language_prompts

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def vision_tokenizer(vision_checkpoint):
    """vLLM's V4.1 tokenizer of the tiny vision checkpoint (the release's tokenizer form)."""
    from vllm.tokenizers.deepseek_v41 import DeepseekV41Tokenizer

    assert vision_language_prompts.apply()
    return DeepseekV41Tokenizer.from_pretrained(vision_checkpoint)


@pytest.mark.parametrize(
    "architecture,asked,expected",
    [
        (VL_ARCH, "auto", "deepseek_v41"),
        (VL_ARCH, "hf", "hf"),  # the operator's choice stands
        (ARCH, "auto", "auto"),  # vLLM's own default for the text class: left to it
        ("LlamaForCausalLM", "auto", "auto"),
    ],
)
def test_the_vision_class_defaults_to_vllms_v41_encoder(architecture, asked, expected):
    class Config:  # what ModelConfig.__post_init__ leaves behind
        def __post_init__(self):
            self._architecture = architecture

    vision_language_prompts._default_tokenizer_mode(Config, VL_ARCH)
    config = Config()
    config.tokenizer_mode = asked
    config.__post_init__()
    assert config.tokenizer_mode == expected


def test_applied_twice_wraps_once():
    from vllm.config.model import ModelConfig
    from vllm.tokenizers import deepseek_v41

    assert vision_language_prompts.apply()
    wrapped = (ModelConfig.__post_init__, deepseek_v41.get_deepseek_v41_tokenizer)
    assert vision_language_prompts.apply()
    assert (ModelConfig.__post_init__, deepseek_v41.get_deepseek_v41_tokenizer) == wrapped


def test_an_image_part_becomes_the_checkpoints_image_token(vision_tokenizer):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "what is it?"},
            ],
        }
    ]
    ids = vision_tokenizer.apply_chat_template(messages, thinking=False)
    assert ids.count(IMAGE_TOKEN_ID) == 1
    prompt = vision_tokenizer.apply_chat_template(messages, thinking=False, tokenize=False)
    assert vision_tokenizer.convert_ids_to_tokens(IMAGE_TOKEN_ID) in prompt
    assert "deepseek_image" not in prompt


def test_text_renders_as_vllms_encoder_renders_it(vision_tokenizer):
    from vllm.tokenizers.deepseek_v41 import encode_messages

    messages = [{"role": "user", "content": "Count to three."}]
    prompt = vision_tokenizer.apply_chat_template(messages, thinking=False, tokenize=False)
    assert prompt == encode_messages(messages, thinking_mode="chat", reasoning_effort="high")


def test_the_tokenizer_still_pickles(vision_tokenizer):
    import pickle

    again = pickle.loads(pickle.dumps(vision_tokenizer))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert again.apply_chat_template(messages, thinking=False).count(IMAGE_TOKEN_ID) == 1
