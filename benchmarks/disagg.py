"""Prefill/decode disaggregation (1P1D over the shared context cache) against one instance,
measured side by side in one run on the plugin's V4.1 in fp32 on the CPU:

- the same fixed mixed load (streamed `/v1/completions`, prompts of several lengths from
  concurrent clients) through one `deepinfer serve` (`single`) and through the router of
  examples/disaggregated_serving.py (`p1d1`): mean time to the first streamed token, mean
  time per output token after it, output tokens per second of the load's wall time;
- the prompt tokens the decode instance replays for one handed-over prompt (its
  `deepinfer:prefix_replayed_tokens_total`): bounded replay's keep, nothing more;
- the KV bytes a 4096-token prompt hands over: what the prefill instance wrote to the
  shared directory (the global KV only) against what moving every KV cache group, the
  window caches included, would have moved.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import requests
from server_process import free_port, start, stop

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fixtures/, tools/

STARTING_ENVIRONMENT = dict(os.environ)
"""The servers' environment: importing vLLM here sets variables of its own (LD_PRELOAD,
LOCAL_WORLD_SIZE, ...) that are not theirs to inherit."""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVED = "tiny-v41"
KV_BYTES_PROMPT = 4096
BLOCK_SIZE = 16
SERVE_ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    str(KV_BYTES_PROMPT + 512),
    "--enforce-eager",
    "--block-size",
    str(BLOCK_SIZE),
    "--served-model-name",
    SERVED,
]
"""Engine flags of the single instance and of both P/D instances alike."""
SERVER_ENV = {"VLLM_PLUGINS": "deepinfer", "VLLM_CPU_KVCACHE_SPACE": "1"}
"""1 GiB of KV space each (as the tests); the rest of the settings at their defaults."""
ROUTER_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""The kv_transfer_params vllm-router's P/D mode sends with its prefill request."""
REPLAYED = "deepinfer:prefix_replayed_tokens_total"
STARTUP_TIMEOUT_S = 600
STOP_TIMEOUT_S = 30
REQUEST_TIMEOUT_S = 600
SETTLE_S = 2.0
"""Block files are counted once their total has not changed for this long."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="checkpoints/tiny-v41-flash",
        help="a V4.1 checkpoint directory (the tiny one is written if absent)",
    )
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[300, 1000, 2000],
        help="prompt lengths of the mixed load, in tokens",
    )
    parser.add_argument(
        "--requests",
        type=int,
        help="requests in the load (the lengths in turn, order shuffled; "
        "default 12, 6 with --quick)",
    )
    parser.add_argument(
        "--clients", type=int, help="concurrent streaming clients (default 4, 3 with --quick)"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        help="output tokens of every request, ignore_eos (default 64, 16 with --quick)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: the smaller defaults above"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the keys to PATH")
    args = parser.parse_args()
    for name, full, quick in (("requests", 12, 6), ("clients", 4, 3), ("max_tokens", 64, 16)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 800) for _ in range(length)]


def server_env() -> dict[str, str]:
    """The starting environment without a parent's in-process engine setting, SERVER_ENV
    added."""
    env = {k: v for k, v in STARTING_ENVIRONMENT.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(SERVER_ENV)
    return env


# --------------------------------------------------------------------- deployments


@contextlib.contextmanager
def single_instance(model: str, cache_dir: str, log_dir: str):
    """One `deepinfer serve` with a context cache directory; yields its URL."""
    log_path = os.path.join(log_dir, "single.log")
    serve_args = ["--context-cache-dir", cache_dir, *SERVE_ARGS]
    server, base = start(model, serve_args, {}, log_path, server_env(), STARTUP_TIMEOUT_S)
    try:
        yield base
    finally:
        stop(server)


@contextlib.contextmanager
def one_prefill_one_decode(model: str, cache_dir: str, log_dir: str):
    """examples/disaggregated_serving.py as a user starts it; yields the URLs of the router,
    the prefill and the decode instance once it prints "ready"."""
    ports = {name: free_port() for name in ("router", "router_metrics", "prefill", "decode")}
    script = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "disaggregated_serving.py"),
            "--model",
            model,
            "--cache-dir",
            cache_dir,
            "--port",
            str(ports["router"]),
            "--router-metrics-port",
            str(ports.pop("router_metrics")),
            "--prefill-port",
            str(ports["prefill"]),
            "--decode-port",
            str(ports["decode"]),
            "--log-dir",
            log_dir,
            "--startup-timeout",
            str(STARTUP_TIMEOUT_S),
            "--stop-timeout",
            str(STOP_TIMEOUT_S),
            "--",
            *SERVE_ARGS,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=server_env(),
        start_new_session=True,
    )
    try:
        line = script.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"the 1P1D deployment did not start ({line.strip()}); see {log_dir}")
        yield {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    finally:
        stop_deployment(script)


def stop_deployment(script: subprocess.Popen) -> None:
    """SIGTERM to the script, which stops the router and both instances (each in a process
    group of its own); if it outlives their stop timeouts, SIGKILL to every group."""
    import psutil

    with contextlib.suppress(ProcessLookupError):
        os.kill(script.pid, signal.SIGTERM)
    try:
        script.wait(timeout=3 * STOP_TIMEOUT_S + 30)
    except subprocess.TimeoutExpired:
        groups = [child.pid for child in psutil.Process(script.pid).children()]
        for pgid in [*groups, script.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        script.wait()


# ---------------------------------------------------------------------------- load


def streamed_completion(base: str, prompt_ids: list[int], max_tokens: int) -> dict:
    """One streamed `/v1/completions`, greedy: seconds to the first token, seconds from the
    first to the last, output tokens (the stream's usage; must be `max_tokens`)."""
    start = time.perf_counter()
    first = last = None
    tokens = 0
    with requests.post(
        f"{base}/v1/completions",
        stream=True,
        timeout=REQUEST_TIMEOUT_S,
        json={
            "model": SERVED,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event}")
            if event.get("choices"):  # a token (the closing usage event has no choices)
                last = time.perf_counter()
                first = first or last
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if tokens != max_tokens or first is None:
        raise RuntimeError(f"a stream brought {tokens} tokens, expected {max_tokens}")
    return {"ttft_s": first - start, "decode_s": last - first, "tokens": tokens}


def run_load(base: str, prompts: list[list[int]], clients: int, max_tokens: int) -> dict:
    """`prompts` streamed by `clients` threads, each taking the next prompt when its reply
    ends; ttft_s and tpot_s are means over the requests."""
    queue = list(reversed(prompts))
    results, errors = [], []
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not queue or errors:
                    return
                ids = queue.pop()
            try:
                result = streamed_completion(base, ids, max_tokens)
            except Exception as e:  # noqa: BLE001 - re-raised below in the main thread
                errors.append(e)
                return
            with lock:
                results.append(result)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    ttfts = [r["ttft_s"] for r in results]
    tpots = [r["decode_s"] / (r["tokens"] - 1) for r in results]
    print(
        f"  {len(results)} requests in {wall:.1f} s; TTFT median {statistics.median(ttfts):.3f}"
        f" s (min {min(ttfts):.3f}, max {max(ttfts):.3f}); TPOT median "
        f"{statistics.median(tpots) * 1e3:.1f} ms",
        flush=True,
    )
    return {
        "ttft_s": statistics.mean(ttfts),
        "tpot_s": statistics.mean(tpots),
        "tok_s": sum(r["tokens"] for r in results) / wall,
    }


def warm_up(base: str, rng: random.Random) -> None:
    """One untimed request, so the load pays no first-forward costs."""
    streamed_completion(base, prompt(rng, 300), 2)


# ------------------------------------------------------------------- handover facts


def metric(base: str, name: str) -> float:
    """The sum of a /metrics series of the server at `base` over its labels."""
    text = requests.get(f"{base}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def decode_replayed_tokens(urls: dict, rng: random.Random) -> int:
    """What the decode instance replays of one fresh prompt handed over through the router
    (the counter moves when the request's finished stats are logged: waited for)."""
    before = metric(urls["decode"], REPLAYED)
    reply = requests.post(
        f"{urls['router']}/v1/completions",
        timeout=REQUEST_TIMEOUT_S,
        json={
            "model": SERVED,
            "prompt": prompt(rng, 1000),
            "max_tokens": 4,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    )
    reply.raise_for_status()
    deadline = time.monotonic() + 30
    while (replayed := metric(urls["decode"], REPLAYED) - before) == 0:
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return round(replayed)


def block_files(directory: str) -> dict[str, int]:
    """Every block file under the context cache `directory`, with its size."""
    sizes = {}
    for path in glob.glob(os.path.join(directory, "**", "*.bin"), recursive=True):
        with contextlib.suppress(OSError):  # an eviction may remove it meanwhile
            sizes[path] = os.path.getsize(path)
    return sizes


def prefill_written_bytes(urls: dict, directory: str, rng: random.Random) -> int:
    """Bytes of the block files a fresh KV_BYTES_PROMPT-token prompt, prefilled as the
    router asks (one token, kv_transfer_params), adds to the shared directory, counted
    once they stop growing (the prefill stores them through the host tier after replying)."""
    before = block_files(directory)
    reply = requests.post(
        f"{urls['prefill']}/v1/completions",
        timeout=REQUEST_TIMEOUT_S,
        json={
            "model": SERVED,
            "prompt": prompt(rng, KV_BYTES_PROMPT),
            "max_tokens": 1,
            "temperature": 0.0,
            "kv_transfer_params": ROUTER_PREFILL,
        },
    )
    reply.raise_for_status()
    written, since, deadline = -1, time.monotonic(), time.monotonic() + 120
    while time.monotonic() < deadline:
        now = sum(size for path, size in block_files(directory).items() if path not in before)
        if now != written:
            written, since = now, time.monotonic()
        elif written > 0 and time.monotonic() - since >= SETTLE_S:
            return written
        time.sleep(0.25)
    raise RuntimeError(f"the prefill's block files did not settle in 120 s ({written} bytes)")


# ------------------------------------------------------------- every KV cache group


def kv_cache_specs(model: str) -> dict:
    """Every paged cache the plugin's V4.1 declares for `model` as the servers run it
    (fp32, BLOCK_SIZE, this environment's keep), from the model built on the meta device."""
    from tools.kv_plan import engine_config
    from tools.kv_plan import kv_cache_specs as declared

    return declared(
        engine_config(
            model, dtype="float32", block_size=BLOCK_SIZE, max_model_len=KV_BYTES_PROMPT + 512
        )
    )


def blocks_held(spec, tokens: int) -> int:
    """Blocks vLLM holds for a request of one cache once `tokens` are computed: one per
    block_size tokens for a full cache; for a sliding window only those from the first
    block holding a token its manager keeps (SlidingWindowManager.get_num_skipped_tokens:
    the window, plus extra_retained_tokens, which bounded replay raises so that the
    replayed tokens' blocks stay; the blocks before are freed)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    blocks = math.ceil(tokens / spec.block_size)
    if not isinstance(spec, SlidingWindowSpec):
        return blocks
    skipped = max(0, tokens - spec.sliding_window + 1 - spec.extra_retained_tokens)
    return blocks - skipped // spec.block_size


def kv_bytes(specs: dict, tokens: int) -> dict[str, int]:
    """Bytes a `tokens`-token prompt holds in the caches `specs` (name -> spec), their
    unpadded pages: `prefix_cached` (the global KV, what the context cache persists) and
    `all_groups` (every cache, windows included). A KV cache group is layers of one spec,
    so summing per cache equals summing page size x layers x blocks per group."""
    held = {
        name: spec.real_page_size_bytes * blocks_held(spec, tokens) for name, spec in specs.items()
    }
    return {
        "prefix_cached": sum(held[name] for name, spec in specs.items() if spec.prefix_cacheable),
        "all_groups": sum(held.values()),
    }


# ---------------------------------------------------------------------------- main


def main() -> int:
    args = parse_args()
    # SIGTERM ends the run through the `finally` blocks that stop the servers.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from fixtures.reference import read_checkpoint
    from fixtures.tiny import write_checkpoint
    from vllm_deepinfer import envs
    from vllm_deepinfer.kv_cache.precision import persisted_bytes_per_token

    if not os.path.exists(os.path.join(args.model, "config.json")):
        write_checkpoint(args.model)
    model = os.path.abspath(args.model)
    keep = envs.load().yoco_prefill_keep_tokens
    computed = kv_bytes(kv_cache_specs(model), KV_BYTES_PROMPT)
    formula = persisted_bytes_per_token(read_checkpoint(model)[0], None, None, 4)

    rng = random.Random(args.seed)
    lengths = [args.lengths[i % len(args.lengths)] for i in range(args.requests)]
    rng.shuffle(lengths)
    prompts = [prompt(rng, length) for length in lengths]
    work = tempfile.mkdtemp(prefix="deepinfer-disagg-")
    print(
        f"load: {args.requests} requests of {lengths} prompt tokens, {args.clients} "
        f"clients, {args.max_tokens} output tokens each; logs and caches under {work}",
        flush=True,
    )
    results = {}
    print("single instance", flush=True)
    with single_instance(model, os.path.join(work, "single-kv"), work) as base:
        warm_up(base, rng)
        results["single"] = run_load(base, prompts, args.clients, args.max_tokens)
    print("1P1D (router, prefill, decode)", flush=True)
    shared = os.path.join(work, "p1d1-kv")
    with one_prefill_one_decode(model, shared, os.path.join(work, "p1d1")) as urls:
        warm_up(urls["router"], rng)
        results["p1d1"] = run_load(urls["router"], prompts, args.clients, args.max_tokens)
        results["decode_replayed_tokens"] = decode_replayed_tokens(urls, rng)
        written = prefill_written_bytes(urls, shared, rng)
    results["kv_bytes_moved_4096"] = {"global_only": written, "all_groups": computed["all_groups"]}

    print(json.dumps(results, indent=2))
    single, p1d1 = results["single"], results["p1d1"]
    print(
        f"1P1D / single: TTFT {p1d1['ttft_s'] / single['ttft_s']:.2f}, TPOT "
        f"{p1d1['tpot_s'] / single['tpot_s']:.2f}, tok/s {p1d1['tok_s'] / single['tok_s']:.2f}"
    )
    print(
        f"decode replayed {results['decode_replayed_tokens']} tokens of a handed-over "
        f"prompt (keep: {keep})"
    )
    print(
        f"{KV_BYTES_PROMPT}-token prompt: the prefill wrote {written} bytes (global KV "
        f"computed from the specs {computed['prefix_cached']}, formula "
        f"{formula * KV_BYTES_PROMPT:.0f}; the rest is block file headers); every KV cache "
        f"group would hold {computed['all_groups']} ({computed['all_groups'] / written:.2f}x)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        from plots import write_plot  # the PNG beside the JSON

        write_plot(
            args.json,
            "1P1D against one instance",
            {
                label: {"": {d: results[d][key] for d in ("single", "p1d1")}}
                for key, label in (
                    ("ttft_s", "time to first token, s"),
                    ("tpot_s", "time per output token, s"),
                    ("tok_s", "output tokens/s"),
                )
            },
        )
    shutil.rmtree(work)  # kept after a failure, for its logs
    return 0


if __name__ == "__main__":
    sys.exit(main())
