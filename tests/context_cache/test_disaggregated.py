"""1P1D through vllm-router, started by examples/disaggregated_serving.py as a user starts
it: answers through the router equal a local prefix hit with bounded replay on the
prefill instance, on vLLM's completions route and on the DeepSeek chat route; SIGTERM to
the script stops the router and both instances, and no process of theirs is left."""
import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests
from helpers import SERVED_NAME, _free_port, group_alive, metric, random_prompts, server_env

from test_served import ROUTER_PREFILL, assert_same_answer, complete

pytestmark = pytest.mark.server

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def deployment(tiny_checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("disagg")
    ports = {name: _free_port() for name in ("router", "prefill", "decode")}
    env = server_env({"DEEPINFER_PD_KV_WAIT_SECONDS": "15"})
    script = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "examples", "disaggregated_serving.py"),
         "--model", tiny_checkpoint, "--cache-dir", str(work / "kv"),
         "--port", str(ports["router"]), "--prefill-port", str(ports["prefill"]),
         "--decode-port", str(ports["decode"]), "--log-dir", str(work / "logs"), "--",
         "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
         "--served-model-name", SERVED_NAME, "--block-size", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        line = script.stdout.readline()  # "ready: ..." once the router answers
        assert line.startswith("ready"), line + script.stdout.read()
        yield script, urls
    finally:
        if script.poll() is None:  # a test failed before stopping it: kill every group
            groups = [child.pid for child in psutil.Process(script.pid).children()]
            for pgid in [script.pid, *groups]:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
            script.wait()


def test_routed_answers_equal_a_local_hit(deployment):
    _, urls = deployment
    prompt = random_prompts((300,), seed=280)[0]
    reply = requests.post(f"{urls['router']}/v1/completions", timeout=300, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
        "logprobs": 0, "ignore_eos": True, "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    routed = {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}
    assert_same_answer(routed, complete(urls["prefill"], prompt))
    assert metric(urls["decode"], EXTERNAL_HITS) >= 288


def test_chat_is_handed_over_through_the_router(deployment):
    """The DeepSeek chat route carries kv_transfer_params both ways: the prefill announces
    its prompt, the decode loads it, and the routed answer equals a direct one."""
    _, urls = deployment
    words = " ".join(f"item{i}" for i in range(160))
    messages = [{"role": "user", "content": f"Repeat the list: {words}"}]
    body = {"model": SERVED_NAME, "messages": messages, "max_tokens": 8, "temperature": 0.0}
    announced = requests.post(f"{urls['prefill']}/v1/chat/completions", timeout=300, json={
        **body, "max_tokens": 1, "kv_transfer_params": ROUTER_PREFILL}).json()
    assert announced["kv_transfer_params"]["deepinfer_global_kv"]["tokens"] == \
        announced["usage"]["prompt_tokens"]
    hits = metric(urls["decode"], EXTERNAL_HITS)
    reply = requests.post(f"{urls['router']}/v1/chat/completions", timeout=300, json=body)
    assert reply.status_code == 200, reply.text
    assert metric(urls["decode"], EXTERNAL_HITS) - hits >= 16 * (announced["usage"]["prompt_tokens"]
                                                         // 16 - 1)
    direct = requests.post(f"{urls['prefill']}/v1/chat/completions", timeout=300, json=body)
    assert (reply.json()["choices"][0]["message"]["content"]
            == direct.json()["choices"][0]["message"]["content"])
    bad = requests.post(f"{urls['prefill']}/v1/chat/completions", timeout=300,
                        json={**body, "kv_transfer_params": "yes"})
    assert bad.status_code == 400 and "kv_transfer_params" in bad.text


def test_sigterm_stops_everything(deployment):
    script, _ = deployment
    groups = [child.pid for child in psutil.Process(script.pid).children()]
    assert len(groups) == 3  # prefill, decode, router
    os.kill(script.pid, signal.SIGTERM)
    assert script.wait(timeout=200) == 0
    deadline = time.monotonic() + 30
    while any(group_alive(pgid) for pgid in groups) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(group_alive(pgid) for pgid in groups)
