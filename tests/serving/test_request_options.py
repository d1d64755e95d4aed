"""The per-request seed reaches vLLM's SamplingParams alike on the three routes: Chat's
through the recipe, Responses' and Messages' from the body (the recipe drops them), and
DeepInfer's `seq_seed` everywhere, the two names agreeing."""

import json

import pytest

from vllm_deepinfer.serving.chat_service import ApiError, ChatService
from vllm_deepinfer.serving.prompts import PromptEncoder
from vllm_deepinfer.serving.protocols import CHAT, MESSAGES, RESPONSES

pytestmark = pytest.mark.unit

HELLO = [{"role": "user", "content": "Hello"}]
BODIES = {
    "chat": (CHAT, {"model": "tiny", "messages": HELLO}),
    "responses": (RESPONSES, {"model": "tiny", "input": "Hello"}),
    "messages": (MESSAGES, {"model": "tiny", "max_tokens": 8, "messages": HELLO}),
}


@pytest.fixture(scope="module")
def service(tiny_checkpoint):
    return ChatService(None, PromptEncoder(tiny_checkpoint), ["tiny"], 4096)


def sampling(service, route, **fields):
    protocol, body = BODIES[route]
    return service.prepare(
        protocol, json.dumps({**body, **fields}).encode(), "application/json"
    ).sampling_params


@pytest.mark.parametrize("route", BODIES)
def test_seed_and_seq_seed_on_every_route(service, route):
    assert sampling(service, route).seed is None
    assert sampling(service, route, seed=7).seed == 7
    assert sampling(service, route, seq_seed=9).seed == 9
    assert sampling(service, route, seed=5, seq_seed=5).seed == 5
    with pytest.raises(ApiError, match=r"seed \(7\) and seq_seed \(8\)"):
        sampling(service, route, seed=7, seq_seed=8)
    with pytest.raises(ApiError) as refused:  # the recipe parses Chat's (a u64)
        sampling(service, route, seed="7")
    assert refused.value.status == 400
