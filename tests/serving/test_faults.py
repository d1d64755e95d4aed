"""Faults on a real `deepinfer serve`, and what each must leave behind:

- The grammar compile worker killed (SIGKILL to the front end's pool process, a child of
  the API server), with a request's grammar in flight: the pool starts a new worker and
  compiles again; that request and later structured requests succeed, new grammars
  compile, and the server keeps serving (on the shared server, which stays healthy).
- The grammar cache on a full disk (DEEPINFER_GRAMMAR_CACHE_DIR on a full tmpfs):
  structured requests succeed and conform, nothing is left in the cache directory, and
  each process that compiles (the compile worker, the engine core) warns once, not per
  request.
- A model worker killed (SIGKILL to a grandchild of the API server: API server -> engine
  core -> workers) with requests in flight, under TP=2 and under DP=2 + EP with EPLB. The
  engine cannot go on without it, so the server must end cleanly: each in-flight client
  gets an error reply (not a hang), /health answers non-200 while the server is still up,
  and the server exits on its own within EXIT_TIMEOUT_S, no process of its group left.
  vLLM 0.32 does this itself: the engine core's executor notices the death, stops the
  other workers (one blocked in a collective with the dead one takes its SIGKILL, after
  5 + 4 s), and the engine core reports itself dead; the front end answers each request
  with ENGINE_STOPPED and vLLM's watchdog (every 5 s) stops the API server.

Each worker case costs a server start; the full-disk case shares the TP=2 one."""

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests

from helpers import (
    NO_THINKING,
    SERVED_NAME,
    TWO_WORKERS,
    data_and_expert_parallel_args,
    full_filesystem,
    group_alive,
    metric,
    serve,
)
from vllm_deepinfer.serving.chat_service import ENGINE_STOPPED
from vllm_deepinfer.structured.compile_pool import WORKER_TITLE

pytestmark = pytest.mark.server

EXIT_TIMEOUT_S = 90  # up to 15 + 4 s to stop the other workers (shutdown_processes), 5 s watchdog
CLIENT_TIMEOUT_S = 120  # far past the exit: a hang shows as a timeout
CHAT = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "Count to a thousand."}],
    "max_tokens": 1500,
    **NO_THINKING,
}
STORE_WARNING = "cannot store compiled grammars"


def _descendants(pid: int, title: str) -> list[psutil.Process]:
    """The processes under `pid` whose title (vLLM's `VLLM::...`) starts with `title`."""
    found = []
    for process in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            if " ".join(process.cmdline()).startswith(title):
                found.append(process)
    return found


def _structured_reply(base: str, tag: str) -> dict:
    """A chat request under a JSON Schema of its own (`tag` names its one property); the
    reply is checked to conform and to end with EOS."""
    schema = {
        "type": "object",
        "properties": {tag: {"enum": ["yes", "no"]}},
        "required": [tag],
        "additionalProperties": False,
    }
    response = requests.post(
        f"{base}/v1/chat/completions",
        timeout=CLIENT_TIMEOUT_S,
        json={
            **CHAT,
            "max_tokens": 32,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema},
            },
        },
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert json.loads(choice["message"]["content"])[tag] in ("yes", "no"), choice
    return choice


def test_the_grammar_compile_worker_killed_is_replaced(api_server):
    """On the shared server: the kill lands while the worker holds a request's grammar
    (stopped first, so the compile cannot finish before it)."""
    base, pid = api_server, api_server.process.pid
    _structured_reply(base, f"p{uuid.uuid4().hex[:8]}")  # the pool's worker is up
    (worker,) = _descendants(pid, f"VLLM::{WORKER_TITLE}")
    compiles = metric(base, "deepinfer:grammar_compiles_total")

    with ThreadPoolExecutor(1) as client:
        worker.send_signal(signal.SIGSTOP)
        try:
            in_flight = client.submit(_structured_reply, base, f"p{uuid.uuid4().hex[:8]}")
            time.sleep(1.0)  # the request's grammar reaches the stopped worker
        finally:
            worker.kill()
        in_flight.result(timeout=CLIENT_TIMEOUT_S)

    _structured_reply(base, f"p{uuid.uuid4().hex[:8]}")
    assert metric(base, "deepinfer:grammar_compiles_total") == compiles + 2
    (replacement,) = _descendants(pid, f"VLLM::{WORKER_TITLE}")
    assert replacement.pid != worker.pid
    deadline = time.monotonic() + 10
    while psutil.pid_exists(worker.pid):
        assert time.monotonic() < deadline, "the killed worker was left a zombie"
        time.sleep(0.1)
    assert requests.get(f"{base}/health", timeout=10).status_code == 200
    log = base.stdout.read_text() + base.stderr.read_text()
    assert log.count("grammar compile pool: a worker process died") == 1


def _kill_a_worker_with_requests_in_flight(base) -> None:
    """A streamed and a whole chat request running; SIGKILL to the last worker (TP rank 1,
    DP rank 1); then the replies, /health and the exit as the module docstring says."""
    pid = base.process.pid
    results: dict = {}
    streaming = threading.Event()  # the streamed reply's first chunk has arrived

    def streamed():
        with requests.post(
            f"{base}/v1/chat/completions",
            json={**CHAT, "stream": True},
            stream=True,
            timeout=CLIENT_TIMEOUT_S,
        ) as response:
            lines = []
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    streaming.set()
            results["streamed"] = (response.status_code, lines)

    def whole():
        response = requests.post(f"{base}/v1/chat/completions", json=CHAT, timeout=CLIENT_TIMEOUT_S)
        results["whole"] = (response.status_code, response.json())

    clients = [threading.Thread(target=streamed), threading.Thread(target=whole)]
    for client in clients:
        client.start()
    deadline = time.monotonic() + 60
    # Both running, the streamed one past its first chunk (its 200 is sent then: a kill
    # before it makes the stream's answer a 503 instead, as for the whole reply).
    while metric(base, "vllm:num_requests_running") != 2 or not streaming.is_set():
        assert time.monotonic() < deadline, "the requests never ran"
        time.sleep(0.2)
    workers = sorted(_descendants(pid, "VLLM::Worker"), key=lambda p: p.cmdline()[0])
    assert len(workers) == 2, [p.cmdline() for p in workers]
    workers[-1].kill()

    health = []  # /health's answers until the server stops answering
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while base.process.poll() is None and time.monotonic() < deadline:
        try:
            health.append(requests.get(f"{base}/health", timeout=5).status_code)
        except requests.ConnectionError:
            break
        time.sleep(0.1)
    assert base.process.wait(timeout=max(deadline - time.monotonic(), 1)) is not None
    for client in clients:
        client.join(timeout=CLIENT_TIMEOUT_S)
    assert set(results) == {"streamed", "whole"}, f"a client got no reply: {results}"
    assert any(code != 200 for code in health), health
    status, body = results["whole"]
    assert status == 503 and body["error"]["message"] == ENGINE_STOPPED, results["whole"]
    status, lines = results["streamed"]
    assert status == 200
    assert json.loads(lines[-1].removeprefix(b"data: "))["error"]["message"] == ENGINE_STOPPED
    deadline = time.monotonic() + 10  # the resource tracker exits after the server
    while group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(pid), "a process of the server outlived it"


def test_a_full_grammar_disk_then_a_tensor_parallel_worker_killed(quantized_checkpoint, tmp_path):
    """Two faults on one TP=2 server of the release form (each rank holding its share of
    the MXFP8 and MXFP4 weights as stored): structured requests on a grammar cache that
    cannot store, then a worker killed under load."""
    with (
        full_filesystem(tmp_path / "full") as cache_dir,
        serve(
            quantized_checkpoint,
            tmp_path,
            "--tensor-parallel-size",
            "2",
            env={**TWO_WORKERS, "DEEPINFER_GRAMMAR_CACHE_DIR": str(cache_dir)},
        ) as base,
    ):
        tags = ["first", "second", "third", "first"]
        for tag in tags:
            _structured_reply(base, tag)
        assert os.listdir(cache_dir) == []  # no grammar and no temporary file
        log = base.stdout.read_text() + base.stderr.read_text()
        assert log.count(STORE_WARNING) == 2, log[-3000:]  # compile worker and engine core
        assert "cannot be read" not in log
        _kill_a_worker_with_requests_in_flight(base)


@pytest.mark.slow  # a DP + EP server of its own (~50 s); a TP=2 worker killed runs by default
def test_a_data_parallel_worker_killed(tiny_checkpoint, tmp_path):
    with serve(
        tiny_checkpoint, tmp_path, *data_and_expert_parallel_args(), env=TWO_WORKERS
    ) as base:
        _kill_a_worker_with_requests_in_flight(base)
