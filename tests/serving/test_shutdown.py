"""A real `deepinfer serve` stopped the two ways users stop it, at many points of a scripted
mixed load, with every core of the machine kept busy: SIGTERM to the server's PID (a
process supervisor, a container runtime) and SIGINT to its whole process group (Ctrl-C in
a terminal). The load is what a server runs at once: long prompts in prefill, decoding
with DSpark speculative verification, a grammar compiling, an image being encoded (and,
on a DP=2 + EP server, experts being rearranged), through the `openai` and `anthropic`
SDKs. Every client ends with an error its SDK raises, or with its whole answer when that
came before the signal; never hangs, never ends with a cut answer that looks whole. The
server exits with status 0 in a stated time, no process of it outlives it, nothing is
force-killed or left to the resource tracker, and no process reports leaks at its exit (the
shutdown_* patches, docs/patches.md).

The default points cost 5 server starts; DEEPINFER_SHUTDOWN_POINTS (seconds after the
load starts, comma-separated, e.g. "0,0.3,1,2,3,5,8,12") sweeps more of them."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import anthropic
import openai
import pytest

from helpers import (
    NO_THINKING,
    SERVED_NAME,
    TWO_WORKERS,
    data_and_expert_parallel_args,
    data_url,
    group_alive,
    image_bytes,
    serve,
)
from vllm_deepinfer.serving.chat_service import ABORTED, ENGINE_STOPPED

pytestmark = pytest.mark.server

# Within these of the signal, on a loaded machine: the server's main process has exited
# (at most the engine core's teardown window, 34 s, its requests' last outputs, 5 s, then
# the HTTP server and the grammar compile workers), and then every process of its group
# (the resource tracker leaves last).
EXIT_TIMEOUT_S = 60
GROUP_EXIT_TIMEOUT_S = 65
CLIENT_TIMEOUT_S = 120  # an SDK's own timeout: far past the exit, so a hang shows as one
# What the log shows of a stop that is not clean: the engine core or its workers killed,
# shared memory or semaphores left to the resource tracker, an error or a traceback, a
# process's exit reporting the objects Triton's bindings still held ("nanobind: leaked").
UNCLEAN = (
    "force killing",
    "sending SIGKILL",
    "leaked semaphore",
    "leaked shared_memory",
    "nanobind: leaked",
    "Traceback",
    "EngineDeadError",
    "exited unexpectedly",
    " ERROR ",
)
# The order a stop takes, whatever the signal.
TIMELINE = (
    "[shutdown] API server: shutdown triggered",
    "[shutdown] API server: engine client stopped",
    "deepinfer front end: grammar compile workers stopped",
)
SHUTDOWN_ERRORS = (ABORTED, ENGINE_STOPPED)
STOPS = ("SIGTERM to the server", "SIGINT to its process group")
POINTS = [
    float(point) for point in os.environ.get("DEEPINFER_SHUTDOWN_POINTS", "0,1.5,4,8").split(",")
]
DSPARK = json.dumps({"method": "dspark", "num_speculative_tokens": 5})

ANSWER_TOKENS = 400
LONG_PROMPT = " ".join(f"item {i} is {i * 7 % 13}." for i in range(120))  # chunked prefill
COMPLETE = {"stop", "length", "end_turn", "max_tokens", "stop_sequence"}


@contextlib.contextmanager
def busy_cores():
    """One spinning process per core, as on a loaded machine; killed when the block ends."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def _fresh_schema() -> dict:
    """A JSON schema not compiled before (its names come from a fresh uuid), so its grammar
    is being compiled when the signal lands instead of read from the cache."""
    tag = uuid.uuid4().hex[:8]
    entry = {
        "type": "object",
        "required": [f"id_{tag}", f"kind_{tag}"],
        "properties": {
            f"id_{tag}": {"type": "string", "pattern": "^[a-z]{2}-[0-9]{3}$"},
            f"kind_{tag}": {"enum": ["alpha", "beta", "gamma", tag]},
            f"score_{tag}": {"type": "integer", "minimum": 0, "maximum": 999},
            f"tags_{tag}": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "maxItems": 4,
            },
        },
    }
    return {
        "type": "object",
        "required": [f"entries_{tag}"],
        "properties": {
            f"entries_{tag}": {"type": "array", "items": entry, "minItems": 1, "maxItems": 6},
            f"note_{tag}": {"type": "string", "maxLength": 80},
        },
    }


def _openai(base: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
    )


def _calls(base: str, prompt: str = LONG_PROMPT, image: bool = True) -> dict:
    """The scripted load: name -> a call that returns its answer's finish or stop reason,
    or raises what its SDK raises."""
    oa = _openai(base)
    claude = anthropic.Anthropic(
        base_url=base, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
    )
    long_chat = dict(
        model=SERVED_NAME,
        max_tokens=ANSWER_TOKENS,
        extra_body=NO_THINKING,
        messages=[{"role": "user", "content": prompt}],
    )
    messages = dict(
        model=SERVED_NAME,
        max_tokens=ANSWER_TOKENS,
        thinking={"type": "disabled"},
        messages=[{"role": "user", "content": "Count to a thousand."}],
    )

    def chat_streamed():
        finish = None
        for chunk in oa.chat.completions.create(**long_chat, stream=True):
            finish = chunk.choices[0].finish_reason if chunk.choices else finish
        return finish

    def chat_structured():
        schema = {"name": "entries", "schema": _fresh_schema()}
        reply = oa.chat.completions.create(
            model=SERVED_NAME,
            max_tokens=ANSWER_TOKENS,
            extra_body=NO_THINKING,
            messages=[{"role": "user", "content": "List the entries."}],
            response_format={"type": "json_schema", "json_schema": schema},
        )
        return reply.choices[0].finish_reason

    def completion():
        return (
            oa.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=ANSWER_TOKENS)
            .choices[0]
            .finish_reason
        )

    def completion_streamed():
        finish = None
        for chunk in oa.completions.create(
            model=SERVED_NAME, prompt="Count to a thousand.", max_tokens=ANSWER_TOKENS, stream=True
        ):
            finish = chunk.choices[0].finish_reason if chunk.choices else finish
        return finish

    def message():
        return claude.messages.create(**messages).stop_reason

    def message_streamed():
        with claude.messages.stream(**messages) as stream:
            events = [event.type for event in stream]
            if "message_stop" not in events:  # cut without an error: it must not pass
                return f"no message_stop after {events[-3:]}"
            return stream.get_final_message().stop_reason

    calls = dict(
        chat_streamed=chat_streamed,
        chat_structured=chat_structured,
        completion=completion,
        completion_streamed=completion_streamed,
        message=message,
        message_streamed=message_streamed,
    )
    if image:
        picture = {"type": "image_url", "image_url": {"url": data_url(image_bytes(640, 480, 0))}}

        def chat_image():
            reply = oa.chat.completions.create(
                model=SERVED_NAME,
                max_tokens=ANSWER_TOKENS,
                extra_body=NO_THINKING,
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "Describe the picture."}, picture],
                    }
                ],
            )
            return reply.choices[0].finish_reason

        calls["chat_image"] = chat_image
    return calls


def _start_grammar_worker(base: str) -> None:
    """A structured request before the load: the front end's grammar compile worker is
    spawned by the first one, and a Ctrl-C while it is still importing kills it (a
    KeyboardInterrupt traceback; the pool's own concern, not the shutdown's)."""
    _openai(base).chat.completions.create(
        model=SERVED_NAME,
        max_tokens=4,
        extra_body=NO_THINKING,
        messages=[{"role": "user", "content": "Hi"}],
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "a",
                "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        },
    )


def _start(calls: dict) -> tuple[dict, list[threading.Thread]]:
    """Runs every call on a thread of its own; outcomes: name -> ("done", reason) or
    ("raised", exception)."""
    outcomes: dict = {}

    def run(name, call):
        try:
            outcomes[name] = ("done", call())
        except Exception as e:  # noqa: BLE001 - what the SDK raised is the outcome
            outcomes[name] = ("raised", e)

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in calls.items()]
    for thread in threads:
        thread.start()
    return outcomes, threads


def _stop_and_time(base, stop: str) -> tuple[float, float]:
    """Sends the signal; seconds until the server's main process exited (with status 0) and
    until no process of its group was left."""
    pid = base.process.pid
    sent = time.monotonic()
    if stop.startswith("SIGTERM"):
        os.kill(pid, signal.SIGTERM)
    else:
        os.killpg(pid, signal.SIGINT)
    assert base.process.wait(timeout=EXIT_TIMEOUT_S) == 0
    main_s = time.monotonic() - sent
    while group_alive(pid) and time.monotonic() - sent < GROUP_EXIT_TIMEOUT_S:
        time.sleep(0.05)
    assert not group_alive(pid), "a process of the server outlived it"
    return main_s, time.monotonic() - sent


def _proper_error(error: Exception) -> bool:
    """The server's shutdown error (on the DeepSeek routes and vLLM's), as the SDK raises
    it: a 503 response, or a stream's error event (OpenAI's error object, Anthropic's
    `event: error`); or a refused connection for a request the server no longer took."""
    if isinstance(error, (openai.APIConnectionError, anthropic.APIConnectionError)):
        return not isinstance(error, (openai.APITimeoutError, anthropic.APITimeoutError))
    if isinstance(error, (openai.APIStatusError, anthropic.APIStatusError)):
        return error.status_code in (200, 503) and any(m in str(error) for m in SHUTDOWN_ERRORS)
    return isinstance(error, openai.APIError) and error.message in SHUTDOWN_ERRORS


def _assert_clients_ended_properly(outcomes: dict, threads, calls: dict) -> str:
    """What each client got, in a line: the SDK's error class, or the answer's end."""
    for thread in threads:
        thread.join(timeout=EXIT_TIMEOUT_S)
    hung = [name for name in calls if name not in outcomes]
    assert hung == []
    improper = {
        name: outcome
        for name, (kind, outcome) in outcomes.items()
        if not (_proper_error(outcome) if kind == "raised" else outcome in COMPLETE)
    }
    assert improper == {}
    return ", ".join(
        f"{name}: {type(outcome).__name__ if kind == 'raised' else outcome}"
        for name, (kind, outcome) in sorted(outcomes.items())
    )


def _assert_clean_log(base) -> None:
    log = base.stdout.read_text() + base.stderr.read_text()
    positions = [log.find(step) for step in TIMELINE]
    assert -1 not in positions, [s for s, p in zip(TIMELINE, positions) if p == -1]
    assert positions == sorted(positions), "the shutdown ran out of order"
    lines = log.splitlines()
    unclean = [
        lines[max(i - 2, 0) : i + 12]
        for i, line in enumerate(lines)
        if any(sign in line for sign in UNCLEAN)
    ]
    assert unclean == []


# The default run stops at the first point (admission, SIGTERM); SIGINT to the group is
# the expert-rearrangement test's. The later points (chunked prefill, decoding and
# verifying) are in the slow run.
@pytest.mark.parametrize(
    "delay,stop",
    [
        pytest.param(
            d,
            STOPS[i % 2],
            id=f"{d}s-{STOPS[i % 2].split()[0]}",
            marks=() if i == 0 else pytest.mark.slow,
        )
        for i, d in enumerate(POINTS)
    ],
)
def test_stop_during_mixed_load(delay, stop, vision_checkpoint, tmp_path):
    """DSpark and the vision model: at 0 s the requests are being admitted (grammar
    compiling, image decoding, scheduling), then prefilled (chunked), then decoded and
    verified."""
    with serve(
        vision_checkpoint,
        tmp_path,
        "--speculative-config",
        DSPARK,
        "--max-num-batched-tokens",
        "256",
        env={"DEEPINFER_GRAMMAR_CACHE_DIR": str(tmp_path / "grammars")},
    ) as base:
        _start_grammar_worker(base)
        calls = _calls(base)
        with busy_cores():
            outcomes, threads = _start(calls)
            time.sleep(delay)
            main_s, group_s = _stop_and_time(base, stop)
            print(
                f"{stop} at {delay} s: main process gone in {main_s:.1f} s, group in "
                f"{group_s:.1f} s"
            )
            print(_assert_clients_ended_properly(outcomes, threads, calls))
    _assert_clean_log(base)


def test_stop_during_expert_rearrangement(tiny_checkpoint, tmp_path):
    """DP=2 + EP with EPLB rearranging every few steps: SIGINT to the group lands while
    experts are moved between the engines' workers."""
    with serve(
        tiny_checkpoint,
        tmp_path,
        *data_and_expert_parallel_args(step_interval=4),
        env=TWO_WORKERS,
    ) as base:

        def rearrangements() -> int:
            return len(
                re.findall("Rearranged experts", base.stdout.read_text() + base.stderr.read_text())
            )

        _start_grammar_worker(base)
        calls = _calls(base, image=False)  # the long prompt: chunked, past the replay keep
        with busy_cores():
            outcomes, threads = _start(calls)
            deadline, first = time.monotonic() + 120, rearrangements()
            while rearrangements() < first + 2:
                assert time.monotonic() < deadline, "no experts were rearranged"
                time.sleep(0.05)
            main_s, group_s = _stop_and_time(base, STOPS[1])
            print(f"EPLB: main process gone in {main_s:.1f} s, group in {group_s:.1f} s")
            print(_assert_clients_ended_properly(outcomes, threads, calls))
    _assert_clean_log(base)
