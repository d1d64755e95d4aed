"""Document and file parts as text.

deepseek-recipe replaces a Messages `document`, a Responses `input_file` and a Chat `file`
part with a placeholder such as "[Unsupported Document]": the user's content would vanish
from the prompt while the request is answered 200. V4.1 reads text, so a part whose
content is text becomes a text part (title and context first, as their own paragraphs);
any other (a PDF, a file id or URL this server cannot read) is refused, naming the part."""

from __future__ import annotations

import base64
import binascii
import os

from vllm_deepinfer.serving.request_options import RequestFieldError

# Media types read as text besides text/*.
TEXT_MEDIA_TYPES = {
    "application/json",
    "application/xml",
    "application/x-yaml",
    "application/yaml",
    "application/javascript",
    "application/x-sh",
    "application/sql",
    "application/toml",
    "application/x-ndjson",
}
# File names read as text when the media type says nothing (application/octet-stream).
TEXT_SUFFIXES = {
    ".txt",
    ".md",
    ".markdown",
    ".csv",
    ".tsv",
    ".json",
    ".jsonl",
    ".xml",
    ".yaml",
    ".yml",
    ".toml",
    ".ini",
    ".cfg",
    ".log",
    ".py",
    ".js",
    ".ts",
    ".java",
    ".c",
    ".h",
    ".cpp",
    ".rs",
    ".go",
    ".rb",
    ".sh",
    ".sql",
    ".html",
    ".css",
    ".tex",
    ".rst",
}
_DOCUMENT_TYPES = ("document", "input_file", "file")  # a tuple: a part's type may be any JSON


def _is_text(media_type, filename: str | None) -> bool:
    """Whether a part is text by its media type (a request's value: any JSON) or, where
    that says nothing, its file name."""
    media_type = media_type.split(";")[0].strip().lower() if isinstance(media_type, str) else ""
    if media_type.startswith("text/") or media_type in TEXT_MEDIA_TYPES:
        return True
    unknown = media_type in ("", "application/octet-stream")
    return unknown and os.path.splitext(filename or "")[1].lower() in TEXT_SUFFIXES


def _decoded(data: str, where: str, what: str) -> str:
    try:
        return base64.b64decode(data, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        raise RequestFieldError(f"{where}: {what} is not base64 of UTF-8 text") from None


def _data_url_text(url: str, filename: str | None, where: str) -> str:
    """The text of a `data:<media type>;base64,<data>` URL, if it holds text."""
    header, sep, data = url.partition(",")
    if not (header.startswith("data:") and header.endswith(";base64") and sep):
        raise RequestFieldError(
            f"{where}: file_data must be a base64 data URL (data:<media type>;base64,...)"
        )
    media_type = header[len("data:") : -len(";base64")]
    if not _is_text(media_type, filename):
        described = f"{filename or 'the file'} ({media_type or 'no media type'})"
        raise RequestFieldError(
            f"{where}: {described} is not text; this server reads text files only"
        )
    return _decoded(data, where, "file_data")


def _not_readable(where: str, what: str) -> RequestFieldError:
    return RequestFieldError(
        f"{where}: {what} cannot be read by this server (it has no Files "
        "API and fetches nothing); send the content inline as text"
    )


def _document_text(part: dict, where: str) -> str:
    """A Messages `document` block's text (source types text, content, base64 text)."""
    source = part.get("source")
    if not isinstance(source, dict):
        raise RequestFieldError(f"{where}: document needs a source object")
    kind = source.get("type")
    if kind == "text" and isinstance(source.get("data"), str):
        body = source["data"]
    elif kind == "content":
        content = source.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list) or not all(
            isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
            for b in blocks
        ):
            raise RequestFieldError(f"{where}: a content document must hold text blocks only")
        body = "\n\n".join(b["text"] for b in blocks)
    elif kind == "base64" and isinstance(source.get("data"), str):
        if not _is_text(source.get("media_type"), None):
            raise RequestFieldError(
                f"{where}: document of type {source.get('media_type')!r} "
                "is not text; this server reads text documents only"
            )
        body = _decoded(source["data"], where, "the document's data")
    elif kind in ("url", "file"):
        raise _not_readable(where, f"a document with a {kind} source")
    else:
        raise RequestFieldError(f"{where}: unsupported document source type {kind!r}")
    heading = [
        part[key] for key in ("title", "context") if isinstance(part.get(key), str) and part[key]
    ]
    return "\n\n".join([*heading, body])


def _file_text(file: dict, where: str) -> str:
    """A Responses `input_file` part or a Chat `file` part's `file` object, as text."""
    filename = file.get("filename") if isinstance(file.get("filename"), str) else None
    if isinstance(file.get("file_data"), str):
        text = _data_url_text(file["file_data"], filename, where)
        return f"{filename}\n\n{text}" if filename else text
    if file.get("file_id") is not None:
        raise _not_readable(where, "a file_id")
    if file.get("file_url") is not None:
        raise _not_readable(where, "a file_url")
    raise RequestFieldError(f"{where}: a file part needs file_data")


def _as_text_part(part: dict, where: str, text_type: str) -> dict:
    kind = part["type"]
    if kind == "document":
        text = _document_text(part, where)
    elif kind == "input_file":
        text = _file_text(part, where)
    else:  # Chat "file": {"type": "file", "file": {...}}
        if not isinstance(part.get("file"), dict):
            raise RequestFieldError(f"{where}: a file part needs a file object")
        text = _file_text(part["file"], where)
    return {"type": text_type, "text": text}


def _content_with_text(content, where: str, text_type: str):
    """A message's content list with its document parts as text parts (nested tool
    results included); None when it has none."""
    if not isinstance(content, list):
        return None
    changed, parts = False, []
    for i, part in enumerate(content):
        here = f"{where}[{i}]"
        if isinstance(part, dict) and part.get("type") in _DOCUMENT_TYPES:
            parts.append(_as_text_part(part, here, text_type))
            changed = True
            continue
        nested = (
            _content_with_text(part.get("content"), f"{here}.content", text_type)
            if isinstance(part, dict)
            else None
        )
        parts.append({**part, "content": nested} if nested is not None else part)
        changed = changed or nested is not None
    return parts if changed else None


def with_text_documents(body: dict, messages_key: str, text_type: str) -> dict | None:
    """`body` with the document parts of its `messages_key` list as `text_type` parts, or
    None when it has none. Raises RequestFieldError for a part that is not text."""
    messages = body.get(messages_key)
    if not isinstance(messages, list):
        return None
    changed, out = False, []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        new = _content_with_text(content, f"{messages_key}[{i}].content", text_type)
        out.append({**message, "content": new} if new is not None else message)
        changed = changed or new is not None
    return {**body, messages_key: out} if changed else None
