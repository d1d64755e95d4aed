"""Document and file parts on a live server: text reaches the prompt (the same tokens as
the text sent as text), anything else is a 400 naming the part."""

import base64

import anthropic
import openai
import pytest

from helpers import NO_THINKING, SERVED_NAME

pytestmark = pytest.mark.server
TEXT = "The quarterly report says revenue rose by nine percent."


def data_url(media_type: str, data: bytes) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def test_messages_text_document_reaches_the_prompt(claude):
    def input_tokens(block):
        reply = claude.messages.create(
            model=SERVED_NAME,
            max_tokens=1,
            thinking={"type": "disabled"},
            messages=[{"role": "user", "content": [block]}],
        )
        return reply.usage.input_tokens + reply.usage.cache_read_input_tokens

    document = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": TEXT},
    }
    assert input_tokens(document) == input_tokens({"type": "text", "text": TEXT})
    pdf = {
        "type": "document",
        "source": {
            "type": "base64",
            "media_type": "application/pdf",
            "data": base64.b64encode(b"%PDF-1.4").decode(),
        },
    }
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[0\]"):
        input_tokens(pdf)


def test_responses_input_file_reaches_the_prompt(oa):
    def input_tokens(part):
        return oa.responses.create(
            model=SERVED_NAME,
            max_output_tokens=1,
            reasoning={"effort": "none"},
            input=[{"role": "user", "content": [part]}],
        ).usage.input_tokens

    text_file = {
        "type": "input_file",
        "filename": "report.txt",
        "file_data": data_url("text/plain", TEXT.encode()),
    }
    assert input_tokens(text_file) == input_tokens(
        {"type": "input_text", "text": f"report.txt\n\n{TEXT}"}
    )
    with pytest.raises(openai.BadRequestError, match="file_id"):
        input_tokens({"type": "input_file", "file_id": "file-123"})


def test_chat_file_part_reaches_the_prompt(oa):
    def prompt_tokens(part):
        return oa.chat.completions.create(
            model=SERVED_NAME,
            max_tokens=1,
            extra_body=NO_THINKING,
            messages=[{"role": "user", "content": [part]}],
        ).usage.prompt_tokens

    file_part = {
        "type": "file",
        "file": {"filename": "r.md", "file_data": data_url("text/markdown", TEXT.encode())},
    }
    assert prompt_tokens(file_part) == prompt_tokens({"type": "text", "text": f"r.md\n\n{TEXT}"})
    with pytest.raises(openai.BadRequestError, match="is not text"):
        prompt_tokens(
            {
                "type": "file",
                "file": {"filename": "a.pdf", "file_data": data_url("application/pdf", b"%PDF")},
            }
        )
