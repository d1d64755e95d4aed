"""`deepinfer serve` (vLLM's own OpenAI server with the plugin) on 127.0.0.1: vLLM's
/v1/completions, whose greedy completions must equal the reference's."""
import requests
import torch
from conftest import SERVED_NAME

from vllm_deepinfer.model.reference import ReferenceV41


def complete(base: str, prompt, **extra) -> requests.Response:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, **extra}
    return requests.post(f"{base}/v1/completions", json=body, timeout=120)


def test_completions_equal_the_reference(api_server, tiny_checkpoint):
    prompt = torch.randint(3, 800, (70,), generator=torch.Generator().manual_seed(11)).tolist()
    response = complete(api_server, prompt, logprobs=1, return_tokens_as_token_ids=True)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    reference = ReferenceV41(tiny_checkpoint)
    logits = reference.logits(prompt + tokens[:-1])
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == tokens
    usage = response.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (70, 8)


def test_text_prompt_and_bad_request_then_keeps_serving(api_server):
    ok = complete(api_server, "The quick brown fox")
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) > 0
    too_long = complete(api_server, "The quick brown fox", max_tokens=100000)
    assert too_long.status_code == 400
    assert "max_tokens" in too_long.text or "context" in too_long.text
    again = complete(api_server, "The quick brown fox")
    assert again.status_code == 200
    assert again.json()["choices"][0]["text"] == ok.json()["choices"][0]["text"]
