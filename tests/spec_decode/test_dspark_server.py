"""`deepinfer serve --speculative-config '{"method": "dspark", ...}'`: the engine core runs
in its own process, so DSpark's counts cross the typed output encoding
(patches/dspark_stats.py) on their way to /metrics; the sampling parameters clients send
(top-k through the openai and anthropic SDKs, streamed and not) are served, those vLLM
does not support with speculation are refused with a 400 naming them, and the server
keeps serving."""

import json
import time

import pytest
import requests

from helpers import NO_THINKING, SERVED_NAME, serve

pytestmark = pytest.mark.server


def scrape(base: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in requests.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("deepinfer:spec_decode") and "_total" in line:
            name = line.split("{")[0].split(" ")[0]
            values[name] = values.get(name, 0.0) + float(line.split()[-1])
    return values


@pytest.mark.slow  # a server of its own (~65 s): docs/development.md's neighbours
def test_dspark_counters_reach_metrics(tiny_checkpoint, tmp_path):
    spec = json.dumps({"method": "dspark", "num_speculative_tokens": 5})
    with serve(
        tiny_checkpoint, tmp_path, "--speculative-config", spec, "--max-num-seqs", "4"
    ) as base:
        reply = greedy(base)
        assert reply["usage"]["completion_tokens"] == 24, reply
        served = serve_sampling_requests(base)
        for _ in range(50):  # counted when the engine's stats arrive
            values = scrape(base)
            if values.get("deepinfer:spec_decode_calibrated_drafts_total", 0) > 0:
                break
            time.sleep(0.1)
    assert values["deepinfer:spec_decode_proposed_tokens_total"] >= 5 * 10
    assert (
        0
        < values["deepinfer:spec_decode_verified_tokens_total"]
        <= values["deepinfer:spec_decode_proposed_tokens_total"]
    )
    assert values["deepinfer:spec_decode_calibrated_drafts_total"] > 0
    assert (
        0
        < values["deepinfer:spec_decode_confidence_sum_total"]
        <= values["deepinfer:spec_decode_calibrated_drafts_total"]
    )
    # Alive after the sampling requests, and the same tokens.
    assert served["choices"][0]["token_ids"] == reply["choices"][0]["token_ids"]


def greedy(base: str) -> dict:
    return requests.post(
        f"{base}/v1/completions",
        timeout=120,
        json={
            "model": SERVED_NAME,
            "prompt": "The quick brown fox jumps over",
            "max_tokens": 24,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    ).json()


def serve_sampling_requests(base: str) -> dict:
    """Top-k (seeded and not) and top-p through both SDKs, then min_p and logit_bias,
    which vLLM does not support with speculative decoding: each a 400 naming it. Returns
    the greedy request's reply afterwards."""
    import anthropic
    import openai

    claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    message = [{"role": "user", "content": "Name three colours."}]
    for seeded in ({}, {"seed": 3}):
        # This anthropic SDK sends sampling parameters as extra body fields.
        options = dict(
            model=SERVED_NAME,
            max_tokens=16,
            messages=message,
            extra_body={**NO_THINKING, "temperature": 0.8, "top_k": 5, **seeded},
        )
        assert claude.messages.create(**options).stop_reason in ("end_turn", "max_tokens")
        with claude.messages.stream(**options) as stream:
            assert stream.get_final_message().stop_reason in ("end_turn", "max_tokens")
        chat = oa.chat.completions.create(
            model=SERVED_NAME,
            messages=message,
            max_tokens=16,
            temperature=0.8,
            top_p=0.5,
            extra_body={**NO_THINKING, "top_k": 5, **seeded},
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
    for name, value in (("min_p", 0.1), ("logit_bias", {"5": 3.0})):
        refused = requests.post(
            f"{base}/v1/completions",
            timeout=120,
            json={"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 4, name: value},
        )
        assert refused.status_code == 400 and name in refused.text, (name, refused.text)
    return greedy(base)
