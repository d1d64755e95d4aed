"""previous_response_id: the conversation a stored response continues."""

import pytest

from vllm_deepinfer.serving.request_options import RequestFieldError
from vllm_deepinfer.serving.response_store import ResponseStore, UnknownResponse

pytestmark = pytest.mark.unit
REPLY = [
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]}
]


def test_a_continued_request_has_the_whole_conversation_first():
    store = ResponseStore()
    store.remember("resp_1", {"input": "Hello", "instructions": "Be brief"}, REPLY)
    body = store.continued({"previous_response_id": "resp_1", "input": "And then?", "model": "m"})
    assert body == {
        "model": "m",
        "input": [
            {"type": "message", "role": "user", "content": "Hello"},
            *REPLY,
            {"type": "message", "role": "user", "content": "And then?"},
        ],
    }
    store.remember("resp_2", body, REPLY)
    assert len(store.continued({"previous_response_id": "resp_2", "input": []})["input"]) == 4


def test_unknown_evicted_and_malformed_ids():
    store = ResponseStore(capacity=2)
    for name in ("a", "b", "c"):
        store.remember(name, {"input": name}, [])
    with pytest.raises(UnknownResponse):
        store.continued({"previous_response_id": "a"})  # the oldest was evicted
    assert store.continued({"previous_response_id": "b"})["input"][0]["content"] == "b"
    with pytest.raises(UnknownResponse):
        store.continued({"previous_response_id": "resp_never"})
    with pytest.raises(RequestFieldError, match="previous_response_id must be a string"):
        store.continued({"previous_response_id": 5})
    assert store.continued({"input": "x"}) is None
