"""Soak: one `deepinfer serve` under a mixed load for a given time, its memory and throughput
watched from start to end.

The server is the tiny vision-language checkpoint with DSpark speculative decoding
(`--no-dspark`: without), the DeepSeek API front end and structured outputs. CLIENTS
threads loop until the time is up, each request drawn from a fixed mix: completions
(greedy and top-k), Chat Completions (streamed and not, a JSON Schema, an image),
Responses, Messages (streamed, top-k). Every reply must be a 200 with the tokens asked
for; anything else counts as an error (the first few are printed).

Written with --json PATH, exactly:
  minutes        the load's duration
  requests       requests completed
  errors         requests that failed (status, exception or missing usage)
  rss_mb         the server's resident memory, its process tree summed (API server,
                 engine core, workers): `start` once the first window has passed (warm),
                 `end` at the end, `max` over the run
  tok_s          completion tokens per second over the first and the last window
                 (`first_5_min`, `last_5_min`; windows of 5 minutes, or half the run
                 when it is shorter than 10)
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import requests
import server_process
from vision import noise_image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fixtures/, tools/

SERVED = "tiny"
WINDOW_S = 300
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}},
    "required": ["name", "count"],
    "additionalProperties": False,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="checkpoints/tiny-v41-flash-vl",
        help="a V4.1 checkpoint with a vision tower (the tiny one is written if absent)",
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--no-dspark", action="store_true", help="serve without speculative decoding"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the keys to PATH")
    return parser.parse_args()


def start_server(model: str, dspark: bool, log_path: str) -> tuple[subprocess.Popen, str]:
    serve_args = [
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--served-model-name",
        SERVED,
        "--reasoning-parser",
        "deepseek_v41",
        "--limit-mm-per-prompt",
        '{"image": 2}',
        "--structured-outputs-config.backend",
        "xgrammar",
        "--structured-outputs-config.disable_any_whitespace",
        "True",
    ]
    if dspark:
        serve_args += [
            "--speculative-config",
            json.dumps({"method": "dspark", "num_speculative_tokens": 5}),
        ]
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_PLUGINS": "deepinfer"}
    return server_process.start(model, serve_args, env, log_path)


def tree_rss_mb(pid: int) -> float:
    import psutil

    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def png_data_url(seed: int) -> str:
    buffer = io.BytesIO()
    noise_image(128, 96, seed).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _words(rng) -> str:
    vocabulary = [
        "cache",
        "window",
        "expert",
        "token",
        "draft",
        "replay",
        "prefix",
        "layer",
        "batch",
        "stream",
        "kernel",
        "index",
        "latent",
        "router",
        "sink",
    ]
    return " ".join(rng.choice(vocabulary, size=int(rng.integers(8, 120))))


def _sse_usage(response, key_path) -> int:
    """Completion tokens from a streamed reply's events (the last usage seen)."""
    tokens = None
    for line in response.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        value = event
        for key in key_path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, int):
            tokens = value
        if event.get("type") == "error" or "error" in event:
            raise RuntimeError(f"stream error: {event}")
    if tokens is None:
        raise RuntimeError("the stream carried no usage")
    return tokens


def one_request(base: str, kind: str, rng, max_tokens: int) -> int:
    """Sends one request of `kind`; its completion tokens, or raises."""
    off = {"type": "disabled"}
    text = _words(rng)
    timeout = 600
    if kind == "completion":
        body = {"model": SERVED, "prompt": text, "max_tokens": max_tokens, "ignore_eos": True}
        if rng.random() < 0.5:
            body.update(temperature=0.8, top_k=5, seed=int(rng.integers(1 << 30)))
        else:
            body.update(temperature=0.0)
        reply = requests.post(f"{base}/v1/completions", json=body, timeout=timeout)
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]
    if kind == "chat_stream":
        reply = requests.post(
            f"{base}/v1/chat/completions",
            stream=True,
            timeout=timeout,
            json={
                "model": SERVED,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens,
                "stream": True,
                "thinking": off,
                "stream_options": {"include_usage": True},
                "temperature": 0.7,
            },
        )
        reply.raise_for_status()
        return _sse_usage(reply, ("usage", "completion_tokens"))
    if kind == "chat_json":
        reply = requests.post(
            f"{base}/v1/chat/completions",
            timeout=timeout,
            json={
                "model": SERVED,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens,
                "thinking": off,
                "temperature": 0.0,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "record", "schema": SCHEMA},
                },
            },
        )
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]
    if kind == "chat_image":
        content = [
            {"type": "image_url", "image_url": {"url": png_data_url(int(rng.integers(1 << 30)))}},
            {"type": "text", "text": text},
        ]
        reply = requests.post(
            f"{base}/v1/chat/completions",
            timeout=timeout,
            json={
                "model": SERVED,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "thinking": off,
                "temperature": 0.0,
            },
        )
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]
    if kind == "responses":
        reply = requests.post(
            f"{base}/v1/responses",
            timeout=timeout,
            json={
                "model": SERVED,
                "input": text,
                "max_output_tokens": max_tokens,
                "reasoning": {"effort": "none"},
                "store": False,
            },
        )
        reply.raise_for_status()
        return reply.json()["usage"]["output_tokens"]
    if kind == "messages_stream":
        reply = requests.post(
            f"{base}/v1/messages",
            stream=True,
            timeout=timeout,
            json={
                "model": SERVED,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens,
                "stream": True,
                "thinking": off,
                "temperature": 0.8,
                "top_k": 5,
            },
        )
        reply.raise_for_status()
        return _sse_usage(reply, ("usage", "output_tokens"))
    raise ValueError(kind)


KINDS = ("completion", "chat_stream", "chat_json", "chat_image", "responses", "messages_stream")


def soak(base: str, server_pid: int, seconds: float, clients: int, max_tokens: int) -> dict:
    started = time.monotonic()
    deadline = started + seconds
    window = min(WINDOW_S, seconds / 2)
    finished: list[tuple[float, int]] = []  # (seconds since start, completion tokens)
    errors: list[str] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        rng = np.random.default_rng(index)
        while time.monotonic() < deadline:
            kind = KINDS[int(rng.integers(len(KINDS)))]
            try:
                tokens = one_request(base, kind, rng, max_tokens)
                with lock:
                    finished.append((time.monotonic() - started, tokens))
            except Exception as exc:  # noqa: BLE001 - every failure is counted
                with lock:
                    errors.append(f"{kind}: {exc}")
                    if len(errors) <= 5:
                        print(f"error: {kind}: {exc}", flush=True)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    samples: list[tuple[float, float]] = []
    while time.monotonic() < deadline:
        samples.append((time.monotonic() - started, tree_rss_mb(server_pid)))
        time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
    for thread in threads:
        thread.join()
    samples.append((time.monotonic() - started, tree_rss_mb(server_pid)))
    warm = [mb for t, mb in samples if t >= window] or [samples[-1][1]]

    def tok_s(lo: float, hi: float) -> float:
        return sum(n for t, n in finished if lo <= t < hi) / (hi - lo)

    return {
        "minutes": seconds / 60,
        "requests": len(finished),
        "errors": len(errors),
        "rss_mb": {"start": warm[0], "end": samples[-1][1], "max": max(mb for _, mb in samples)},
        "tok_s": {"first_5_min": tok_s(0, window), "last_5_min": tok_s(seconds - window, seconds)},
    }


def main() -> None:
    args = parse_args()
    if not os.path.exists(os.path.join(args.model, "config.json")):
        from fixtures.tiny import write_checkpoint

        write_checkpoint(args.model, vision=True)
    log_path = os.path.join(tempfile.mkdtemp(prefix="soak-"), "server.log")
    server, base = start_server(args.model, not args.no_dspark, log_path)
    print(f"server log: {log_path}", flush=True)
    try:
        result = soak(base, server.pid, args.minutes * 60, args.clients, args.max_tokens)
    finally:
        server_process.stop(server)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        from plots import write_plot  # the PNG beside the JSON

        write_plot(
            args.json,
            f"Soak: {result['requests']} requests, {result['errors']} "
            f"errors in {result['minutes']:.0f} min",
            {
                "server RSS, MB": {"": result["rss_mb"]},
                "completion tokens/s": {"": result["tok_s"]},
            },
        )


if __name__ == "__main__":
    main()
