"""Document and file parts become text where they are text, else a 400 naming the part."""

import base64

import pytest

from vllm_deepinfer.serving.documents import with_text_documents
from vllm_deepinfer.serving.request_options import RequestFieldError

pytestmark = pytest.mark.unit


def data_url(text: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(text).decode()}"


def messages_body(*parts):
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Sum up"}]}]}


def test_messages_text_document_with_title_and_context():
    body = messages_body(
        {
            "type": "document",
            "title": "Notes",
            "context": "From Ann",
            "source": {"type": "text", "media_type": "text/plain", "data": "Line one"},
        }
    )
    content = with_text_documents(body, "messages", "text")["messages"][0]["content"]
    assert content == [
        {"type": "text", "text": "Notes\n\nFrom Ann\n\nLine one"},
        {"type": "text", "text": "Sum up"},
    ]
    assert body["messages"][0]["content"][0]["type"] == "document"  # the input is not changed


@pytest.mark.parametrize(
    "source,text",
    [
        (
            {
                "type": "content",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            "a\n\nb",
        ),
        ({"type": "content", "content": "plain"}, "plain"),
        (
            {
                "type": "base64",
                "media_type": "text/plain",
                "data": base64.b64encode("é ok".encode()).decode(),
            },
            "é ok",
        ),
    ],
)
def test_messages_document_sources_read_as_text(source, text):
    body = messages_body({"type": "document", "source": source})
    assert with_text_documents(body, "messages", "text")["messages"][0]["content"][0] == {
        "type": "text",
        "text": text,
    }


@pytest.mark.parametrize(
    "source,words",
    [
        (
            {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="},
            "'application/pdf'",
        ),
        ({"type": "url", "url": "https://example.com/a.pdf"}, "url source"),
        ({"type": "file", "file_id": "file_1"}, "file source"),
        (
            {
                "type": "base64",
                "media_type": "text/plain",
                "data": base64.b64encode(b"\xff").decode(),
            },
            "not base64 of UTF-8",
        ),
    ],
)
def test_messages_documents_that_are_not_text_are_refused(source, words):
    with pytest.raises(RequestFieldError, match=r"messages\[0\]\.content\[0\]") as error:
        with_text_documents(
            messages_body({"type": "document", "source": source}), "messages", "text"
        )
    assert words in str(error.value)


def test_responses_input_file_as_text():
    body = {
        "input": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "input_file",
                        "filename": "a.md",
                        "file_data": data_url(b"# Title", "text/markdown"),
                    },
                    {
                        "type": "input_file",
                        "filename": "b.json",
                        "file_data": data_url(b'{"k": 1}', "application/octet-stream"),
                    },
                ],
            }
        ]
    }
    content = with_text_documents(body, "input", "input_text")["input"][0]["content"]
    assert content == [
        {"type": "input_text", "text": "a.md\n\n# Title"},
        {"type": "input_text", "text": 'b.json\n\n{"k": 1}'},
    ]


@pytest.mark.parametrize(
    "part,words",
    [
        (
            {
                "type": "input_file",
                "filename": "a.pdf",
                "file_data": data_url(b"%PDF", "application/pdf"),
            },
            "a.pdf (application/pdf) is not text",
        ),
        ({"type": "input_file", "file_id": "file-abc"}, "file_id"),
        ({"type": "input_file", "file_url": "https://example.com/a.txt"}, "file_url"),
        ({"type": "input_file", "file_data": "not a data url"}, "base64 data URL"),
    ],
)
def test_responses_files_that_cannot_be_read_are_refused(part, words):
    with pytest.raises(RequestFieldError, match=r"input\[0\]\.content\[0\]") as error:
        with_text_documents({"input": [{"role": "user", "content": [part]}]}, "input", "input_text")
    assert words in str(error.value)


def test_chat_file_part_and_nested_tool_result():
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "file",
                        "file": {"filename": "n.txt", "file_data": data_url(b"hi", "text/plain")},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [
                            {
                                "type": "document",
                                "source": {
                                    "type": "text",
                                    "media_type": "text/plain",
                                    "data": "inner",
                                },
                            }
                        ],
                    }
                ],
            },
        ]
    }
    messages = with_text_documents(body, "messages", "text")["messages"]
    assert messages[0]["content"] == [{"type": "text", "text": "n.txt\n\nhi"}]
    assert messages[1]["content"][0]["content"] == [{"type": "text", "text": "inner"}]


def test_bodies_without_documents_are_left_alone():
    assert (
        with_text_documents({"messages": [{"role": "user", "content": "hi"}]}, "messages", "text")
        is None
    )
    assert with_text_documents({"input": "hi"}, "input", "input_text") is None
