"""An error in a stream already under way (the engine stopped, a shutdown abort) reaches
the client in its protocol's shape: Messages as Anthropic's named `error` event, which
its SDK raises (an unnamed one it skips, and the cut answer would look whole); Chat and
Responses as an OpenAI error object on a data line. The streams are the recipe's own
events for real tokens, written by the front end's SSE writer."""

import asyncio
import json

import anthropic
import deepseek_recipe as dr
import httpx2
import pytest

from vllm_deepinfer.serving.chat_service import ABORTED, ApiError, ChatService
from vllm_deepinfer.serving.frontend import _sse
from vllm_deepinfer.serving.prompts import PromptEncoder
from vllm_deepinfer.serving.protocols import CHAT, MESSAGES, ServedChunk

pytestmark = pytest.mark.unit

HELLO = [{"role": "user", "content": "Hello"}]
BODIES = {
    CHAT: {"model": "tiny", "messages": HELLO, "stream": True, "thinking": {"type": "disabled"}},
    MESSAGES: {
        "model": "tiny",
        "max_tokens": 8,
        "messages": HELLO,
        "stream": True,
        "thinking": {"type": "disabled"},
    },
}


@pytest.fixture(scope="module")
def service(tiny_checkpoint):
    return ChatService(None, PromptEncoder(tiny_checkpoint), ["tiny"], 4096)


def stream_cut_by(service, protocol, error: ApiError) -> bytes:
    """What the front end sends for a stream whose engine output ends in `error` after
    a few answer tokens."""
    prepared = service.prepare(protocol, json.dumps(BODIES[protocol]).encode(), "application/json")
    processor = service._processor(prepared)
    answer = service.encoder._plain.encode("Hello there", add_special_tokens=False).ids

    async def events():
        usage = dr.PromptUsage(prompt_tokens=len(prepared.prompt_ids), prompt_cache_hit_tokens=0)
        for chunk in [
            *processor.push(dr.InferenceChunk.ready(prompt_usage=usage, system_fingerprint=None)),
            *processor.push(dr.InferenceChunk.tokens(answer, None)),
        ]:
            yield ServedChunk(chunk, 0)
        raise error

    async def written():
        return "".join([part async for part in _sse(protocol, None, events())])

    return asyncio.run(written()).encode()


def test_messages_stream_error_is_a_named_anthropic_error_event(service):
    sent = stream_cut_by(service, MESSAGES, ApiError(503, ABORTED))
    events = sent.decode().split("\n\n")
    assert events[-1] == "" and "event: content_block_delta" in sent.decode()
    assert events[-2] == "event: error\ndata: " + json.dumps(
        {"type": "error", "error": {"type": "api_error", "message": ABORTED}}, separators=(",", ":")
    )


def test_chat_stream_error_stays_an_openai_data_line(service):
    sent = stream_cut_by(service, CHAT, ApiError(500, "generation ended with error"))
    last = sent.decode().split("\n\n")[-2]
    assert last.startswith("data: ") and "event:" not in last
    assert json.loads(last[len("data: ") :])["error"]["message"] == "generation ended with error"


def test_anthropic_client_raises_on_a_cut_stream(service):
    """anthropic's own stream reader, over the bytes the front end sends: the text before
    the error arrives, then the error is raised."""
    sent = stream_cut_by(service, MESSAGES, ApiError(503, ABORTED))
    transport = httpx2.MockTransport(
        lambda request: httpx2.Response(
            200, headers={"content-type": "text/event-stream"}, content=sent
        )
    )
    client = anthropic.Anthropic(
        base_url="http://deepinfer.test",
        api_key="unused",
        max_retries=0,
        http_client=httpx2.Client(transport=transport),
    )
    received = []
    with (
        pytest.raises(anthropic.APIStatusError) as raised,
        client.messages.stream(model="tiny", max_tokens=8, messages=HELLO) as stream,
    ):
        received.extend(stream.text_stream)
    assert "".join(received)  # the answer so far reached the client
    assert raised.value.body == {
        "type": "error",
        "error": {"type": "api_error", "message": ABORTED},
    }
