"""1E1P1D through vllm-router, started by examples/disaggregated_serving.py as a user starts
it, on the vision-language checkpoint: answers through the deployment equal a local prefix
hit with bounded replay on the prefill instance, on vLLM's completions route and on the
DeepSeek routes with images (each image encoded once, by the encoder instance); with the
encoder down, images are encoded by the prefill instance and answers stay the same;
SIGTERM to the script stops every process, and none of theirs is left."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests
from test_served import ROUTER_PREFILL, assert_same_answer, complete

from helpers import (
    NO_THINKING,
    SERVED_NAME,
    SERVER_ARGS,
    _free_port,
    data_url,
    group_alive,
    image_bytes,
    metric,
    random_prompts,
    server_env,
)

pytestmark = pytest.mark.server

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def deployment(vision_checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("disagg")
    ports = {
        name: _free_port()
        for name in ("front", "router", "router-metrics", "prefill", "decode", "encoder")
    }
    env = server_env({"DEEPINFER_PD_KV_WAIT_SECONDS": "15"})
    script = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "disaggregated_serving.py"),
            "--model",
            vision_checkpoint,
            "--cache-dir",
            str(work / "kv"),
            "--encoder-cache-dir",
            str(work / "ec"),
            "--port",
            str(ports["front"]),
            "--router-port",
            str(ports["router"]),
            "--router-metrics-port",
            str(ports["router-metrics"]),
            "--prefill-port",
            str(ports["prefill"]),
            "--decode-port",
            str(ports["decode"]),
            "--encoder-port",
            str(ports["encoder"]),
            "--log-dir",
            str(work / "logs"),
            "--",
            *SERVER_ARGS,
            "--block-size",
            "16",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        line = script.stdout.readline()  # "ready: ..." once the router answers
        assert line.startswith("ready"), line + script.stdout.read()
        yield script, urls, work
    finally:
        if script.poll() is None:  # a test failed before stopping it: kill every group
            groups = [child.pid for child in psutil.Process(script.pid).children()]
            for pgid in [script.pid, *groups]:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
            script.wait()


def test_routed_answers_equal_a_local_hit(deployment):
    _, urls, _ = deployment
    prompt = random_prompts((300,), seed=280)[0]
    reply = requests.post(
        f"{urls['front']}/v1/completions",
        timeout=300,
        json={
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0.0,
            "logprobs": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    routed = {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}
    assert_same_answer(routed, complete(urls["prefill"], prompt))
    assert metric(urls["decode"], EXTERNAL_HITS) >= 288


def test_chat_is_handed_over_through_the_router(deployment):
    """The DeepSeek chat route carries kv_transfer_params both ways: the prefill announces
    its prompt, the decode loads it, and the routed answer equals a direct one."""
    _, urls, _ = deployment
    words = " ".join(f"item{i}" for i in range(160))
    messages = [{"role": "user", "content": f"Repeat the list: {words}"}]
    body = {"model": SERVED_NAME, "messages": messages, "max_tokens": 8, "temperature": 0.0}
    announced = requests.post(
        f"{urls['prefill']}/v1/chat/completions",
        timeout=300,
        json={**body, "max_tokens": 1, "kv_transfer_params": ROUTER_PREFILL},
    ).json()
    assert (
        announced["kv_transfer_params"]["deepinfer_global_kv"]["tokens"]
        == announced["usage"]["prompt_tokens"]
    )
    hits = metric(urls["decode"], EXTERNAL_HITS)
    reply = requests.post(f"{urls['front']}/v1/chat/completions", timeout=300, json=body)
    assert reply.status_code == 200, reply.text
    assert metric(urls["decode"], EXTERNAL_HITS) - hits >= 16 * (
        announced["usage"]["prompt_tokens"] // 16 - 1
    )
    direct = requests.post(f"{urls['prefill']}/v1/chat/completions", timeout=300, json=body)
    assert (
        reply.json()["choices"][0]["message"]["content"]
        == direct.json()["choices"][0]["message"]["content"]
    )
    bad = requests.post(
        f"{urls['prefill']}/v1/chat/completions",
        timeout=300,
        json={**body, "kv_transfer_params": "yes"},
    )
    assert bad.status_code == 400 and "kv_transfer_params" in bad.text


WORDS = " ".join(f"item{i}" for i in range(150))


def image_request(route: str, first: bytes, second: bytes) -> tuple[str, dict]:
    """The route's path and body: an image, a long text, an image (the second one within
    the tokens the decode instance replays), asking for 6 greedy tokens (thinking off:
    thinking mode samples at DeepSeek's fixed temperature)."""
    if route == "chat":
        return "/v1/chat/completions", {
            **NO_THINKING,
            "model": SERVED_NAME,
            "max_tokens": 6,
            "temperature": 0.0,
            "logprobs": True,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(first)}},
                        {"type": "text", "text": f"Compare the pictures: {WORDS}"},
                        {"type": "image_url", "image_url": {"url": data_url(second)}},
                    ],
                }
            ],
        }
    if route == "responses":
        return "/v1/responses", {
            "reasoning": {"effort": "none"},
            "model": SERVED_NAME,
            "max_output_tokens": 6,
            "temperature": 0.0,
            "store": False,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": data_url(first)},
                        {"type": "input_text", "text": f"Compare the pictures: {WORDS}"},
                        {"type": "input_image", "image_url": data_url(second)},
                    ],
                }
            ],
        }
    source = [
        {
            "type": "image",
            "source": {
                "type": "base64",
                "media_type": "image/png",
                "data": data_url(image).split(",", 1)[1],
            },
        }
        for image in (first, second)
    ]
    return "/v1/messages", {
        **NO_THINKING,
        "model": SERVED_NAME,
        "max_tokens": 6,
        "temperature": 0.0,
        "messages": [
            {
                "role": "user",
                "content": [
                    source[0],
                    {"type": "text", "text": f"Compare the pictures: {WORDS}"},
                    source[1],
                ],
            }
        ],
    }


def answer(route: str, reply: dict):
    """What must match: the text, and the logprobs where the route returns them."""
    if route == "chat":
        choice = reply["choices"][0]
        return choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]]
    if route == "responses":
        return [part.get("text") for item in reply["output"] for part in item["content"]]
    return reply["content"]


def assert_routed_equals_direct(urls: dict, route: str, seed: int) -> None:
    path, body = image_request(route, image_bytes(64, 48, seed), image_bytes(48, 64, seed + 1))
    hits = metric(urls["decode"], EXTERNAL_HITS)
    routed = requests.post(f"{urls['front']}{path}", timeout=300, json=body)
    assert routed.status_code == 200, routed.text
    assert metric(urls["decode"], EXTERNAL_HITS) - hits >= 16 * 10  # the handoff happened
    direct = requests.post(f"{urls['prefill']}{path}", timeout=300, json=body)
    assert direct.status_code == 200, direct.text
    routed, direct = answer(route, routed.json()), answer(route, direct.json())
    if route == "chat":
        assert routed[0] == direct[0]
        assert routed[1] == pytest.approx(direct[1], abs=1e-5)
    else:
        assert routed == direct


def encoded_images(directory) -> int:
    return len(list(directory.glob("*/encoder_cache.safetensors")))


@pytest.mark.parametrize("route", ["chat", "responses", "messages"])
def test_images_are_encoded_by_the_encoder_and_handed_over(deployment, route):
    _, urls, work = deployment
    before = encoded_images(work / "ec")
    assert_routed_equals_direct(urls, route, seed=2701 + 10 * len(route))
    assert encoded_images(work / "ec") == before + 2


def instance(script, port: int) -> psutil.Process:
    """The process group leader the script started with `--port PORT`."""
    [leader] = [
        child for child in psutil.Process(script.pid).children() if str(port) in child.cmdline()
    ]
    return leader


def test_encoder_down_images_are_encoded_by_the_prefill(deployment):
    script, urls, work = deployment
    # The encoder instance built and loaded the vision tower only.
    assert "tensors, not the language model" in (work / "logs" / "encoder.log").read_text()
    encoder = instance(script, int(urls["encoder"].rsplit(":", 1)[1]))
    os.killpg(encoder.pid, signal.SIGKILL)
    encoder.wait(timeout=60)
    before = encoded_images(work / "ec")
    assert_routed_equals_direct(urls, "chat", seed=2790)
    assert encoded_images(work / "ec") == before
    assert script.poll() is None  # the rest keeps serving


def test_sigterm_stops_everything(deployment):
    script, _, _ = deployment
    groups = [child.pid for child in psutil.Process(script.pid).children()]
    assert len(groups) == 4  # prefill, decode, router, front (the encoder was stopped)
    os.kill(script.pid, signal.SIGTERM)
    assert script.wait(timeout=200) == 0
    deadline = time.monotonic() + 30
    while any(group_alive(pgid) for pgid in groups) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(group_alive(pgid) for pgid in groups)
