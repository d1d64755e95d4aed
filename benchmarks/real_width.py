"""A real-width slice of V4.1-Flash served on this machine: memory and speed.

`python benchmarks/real_width.py --checkpoint DIR --json rw.json` writes the slice there
first when DIR has no config.json (`python -m fixtures.tiny --real-width --layers N`:
about 17 GB for two layers, two minutes), then serves it with `deepinfer serve` in bf16
(bounded replay, prefix caching and the context cache on; release precision kept) and
measures, one after the other on the same cores:

- the resident memory of every process of the server after loading and after decoding,
  against the checkpoint's bytes (the Engram tables counted apart: they are mapped);
- the machine's read bandwidth, with the engine's thread count (after the server stops);
- decode tokens/s at 1 and 8 concurrent requests, prefill tokens/s of a 512-token prompt;
- `tiled`: decode tokens/s again on a second server that multiplies every quantized
  weight through the dequantize-per-tile path (DEEPINFER_MX_KERNEL=tiled), the fallback
  the plugin's C kernel (kernels/weight_gemv.py) replaces;
- `bandwidth_fraction`: decode tokens/s x bytes read per step / read bandwidth, per batch;
- the bytes a decode step reads, counted from the layout (the active experts' expected
  count, every other weight of each layer, the head, the looked-up Engram rows);
- `dequantized`: a one-layer slice served the old way (`--quantization
  deepinfer_dequantized`), or null where its dequantized experts alone exceed the memory
  this machine has (it says so).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from server_process import free_port

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fixtures/

KV_SPACE_GIB = 1
PREFILL_TOKENS = 512
BATCHES = (1, 8)
STARTUP_TIMEOUT_S = 1800
BANDWIDTH_SETTLE_S = 10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="checkpoints/real-width-v41-flash")
    parser.add_argument("--layers", type=int, default=2, help="layers of a slice written here")
    parser.add_argument("--engram-rows", type=int, default=None, help="rows per Engram table")
    parser.add_argument("--decode-tokens", type=int, default=6, help="tokens per decode run")
    parser.add_argument("--json", help="write the results here (and a PNG beside it)")
    return parser.parse_args()


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            with open(f"/proc/{current}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            with open(f"/proc/{current}/task/{current}/children") as f:
                todo.extend(int(child) for child in f.read().split())
        except FileNotFoundError:
            continue
    return total


class Server:
    """`deepinfer serve CHECKPOINT` in its own process group, bf16, eager."""

    def __init__(self, checkpoint: str, log_dir: str, *extra: str, environment: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB), **(environment or {})}
        self.log_path = os.path.join(log_dir, f"server-{self.port}.log")
        command = [
            sys.executable,
            "-m",
            "vllm_deepinfer.serving.cli",
            "serve",
            checkpoint,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            "v41",
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            str(max(BATCHES)),
            "--max-num-batched-tokens",
            str(PREFILL_TOKENS),
            "--enable-prefix-caching",
            *extra,
        ]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._wait()

    def _wait(self) -> None:
        import requests

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited; log tail:\n{self.log()[-4000:]}")
            try:
                if requests.get(f"{self.base}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise RuntimeError(f"server not up in {STARTUP_TIMEOUT_S} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def rss_bytes(self) -> int:
        return tree_rss_bytes(self.process.pid)

    def stream(self, prompt: list[int], max_tokens: int) -> dict:
        """One streamed completion: seconds to the first token and to the last, tokens."""
        import requests

        start = time.perf_counter()
        first = last = None
        tokens = 0
        body = {
            "model": "v41",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with requests.post(f"{self.base}/v1/completions", json=body, stream=True) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: ") :])
                if "error" in chunk:
                    raise RuntimeError(f"the server answered {chunk['error']}")
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    tokens += 1
                    last = time.perf_counter() - start
                    first = last if first is None else first
        return {"first_s": first, "last_s": last, "tokens": tokens}

    def close(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=120)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def read_bandwidth_gbs(threads: int, size_bytes: int = 1 << 30, rounds: int = 10) -> float:
    """Best of `rounds` sums over a buffer far larger than the caches, `threads` threads.
    Taken after a pause once the servers are gone, and best of many: taken at once and
    best of five over 512 MiB, it read 12.7 GB/s in one run where the idle machine reads
    15-17 GB/s, and the decode it bounds read 13.0 (a fraction above 1)."""
    import torch

    time.sleep(BANDWIDTH_SETTLE_S)
    torch.set_num_threads(threads)
    buffer = torch.ones(size_bytes // 4, dtype=torch.float32)
    buffer.sum()
    best = min(_timed(buffer.sum) for _ in range(rounds))
    del buffer
    return size_bytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def engine_threads(server_pid: int) -> int:
    """The CPUs the server's worker may run on (vLLM binds one OpenMP thread to each)."""
    todo = [server_pid]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/comm") as f:
                if "Worker" in f.read():
                    return len(os.sched_getaffinity(pid))
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                todo.extend(int(child) for child in f.read().split())
        except FileNotFoundError:
            continue
    return os.cpu_count() or 1


def layout_bytes(checkpoint: str) -> tuple[dict, dict]:
    """The slice's layout and its stored bytes per logical tensor."""
    from vllm_deepinfer.checkpoint.layout import checkpoint_layout
    from vllm_deepinfer.model.deepseek_v41.args import V41Args

    with open(os.path.join(checkpoint, "config.json")) as f:
        args = V41Args.from_release_config(json.load(f))
    layout = checkpoint_layout(args, quantized=True)
    stored = {
        name: sum(_numel(shape) * dtype.itemsize for shape, dtype in spec.stored(name).values())
        for name, spec in layout.items()
    }
    return {"args": args, "layout": layout}, stored


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def bytes_per_decode_step(model: dict, stored: dict, batch: int) -> int:
    """Weights (and Engram rows) one decode step of `batch` sequences reads: per layer the
    expected distinct experts among batch x top-k uniform draws, every other tensor of the
    layer but the Engram table, that table's looked-up rows; the head, the batch's
    embedding rows. DSpark stages are not read (no speculation)."""
    a = model["args"]
    experts, top_k = a.n_routed_experts, a.num_experts_per_tok
    active = experts * (1 - (1 - top_k / experts) ** batch)
    total = stored["head.weight"] + stored["norm.weight"]
    total += batch * stored["embed.weight"] // a.vocab_size
    for name, size in stored.items():
        if not name.startswith("layers."):
            continue
        if ".ffn.experts." in name:
            total += size * active / experts
        elif ".engram.embed." in name:
            rows = model["layout"][name].shape[0]
            total += batch * a.engram_columns * size / rows
        else:
            total += size
    return int(total)


def checkpoint_bytes(checkpoint: str, stored: dict) -> tuple[int, int]:
    """(every weight file's bytes, the Engram tables' stored bytes with their scales)."""
    with open(os.path.join(checkpoint, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    total = sum(os.path.getsize(os.path.join(checkpoint, file)) for file in files)
    engram = sum(size for name, size in stored.items() if ".engram.embed." in name)
    return total, engram


def measure(server: Server, decode_tokens: int, rng: random.Random) -> dict:
    """Decode tokens/s at each batch (fresh 16-token prompts), prefill tokens/s."""

    def fresh(length: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(length)]

    server.stream(fresh(16), 2)  # untimed: first-forward costs
    decode = {}
    for batch in BATCHES:
        with ThreadPoolExecutor(batch) as pool:
            runs = list(
                pool.map(
                    lambda p: server.stream(p, decode_tokens), [fresh(16) for _ in range(batch)]
                )
            )
        per_request = [(run["tokens"] - 1) / (run["last_s"] - run["first_s"]) for run in runs]
        decode[str(batch)] = sum(per_request)
        print(f"  decode at {batch}: {decode[str(batch)]:.3f} tokens/s", flush=True)
    return decode


def prefill(server: Server, rng: random.Random) -> float:
    run = server.stream([rng.randrange(3, 1000) for _ in range(PREFILL_TOKENS)], 1)
    print(f"  prefill of {PREFILL_TOKENS}: {run['first_s']:.1f} s to the first token", flush=True)
    return PREFILL_TOKENS / run["first_s"]


def dequantized_figures(args, model: dict, stored: dict, work: str, rng) -> dict | None:
    """A one-layer slice loaded the old way, or None where its experts alone, widened to
    bf16, need more memory than this machine has available."""
    a = model["args"]
    expert_values = 3 * a.moe_intermediate_size * a.hidden_size * a.n_routed_experts
    needed = 2 * expert_values + 2 * 2 * a.vocab_size * a.hidden_size
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if "MemAvailable" in line)
    if needed > available:
        print(
            f"dequantized: null. A one-layer slice dequantized to bf16 needs "
            f"{needed / 2**30:.1f} GiB for its experts, embedding and head alone; this "
            f"machine has {available / 2**30:.1f} GiB available",
            flush=True,
        )
        return None
    from fixtures.real_width import write_real_width

    one_layer = os.path.join(work, "one-layer")
    write_real_width(one_layer, layers=1)
    server = Server(one_layer, work, "--quantization", "deepinfer_dequantized")
    try:
        decode = measure(server, args.decode_tokens, rng)
        return {"rss_bytes": server.rss_bytes(), "decode_tok_s": {"1": decode["1"]}}
    finally:
        server.close()
        shutil.rmtree(one_layer, ignore_errors=True)


def main() -> int:
    args = parse_args()
    from fixtures.real_width import DEFAULT_ENGRAM_ROWS, write_real_width

    if not os.path.exists(os.path.join(args.checkpoint, "config.json")):
        print(f"writing a {args.layers}-layer real-width slice to {args.checkpoint}", flush=True)
        write_real_width(args.checkpoint, args.layers, args.engram_rows or DEFAULT_ENGRAM_ROWS)
    model, stored = layout_bytes(args.checkpoint)
    a = model["args"]
    total, engram = checkpoint_bytes(args.checkpoint, stored)
    rng = random.Random(0)
    work = tempfile.mkdtemp(prefix="deepinfer-real-width-")
    try:
        server = Server(
            args.checkpoint, work, "--context-cache-dir", os.path.join(work, "context-cache")
        )
        try:
            after_load = server.rss_bytes()
            if "Release precision kept in memory" not in server.log():
                raise RuntimeError("the slice was not served in release precision")
            threads = engine_threads(server.process.pid)
            decode = measure(server, args.decode_tokens, rng)
            after_decode = server.rss_bytes()
            prefill_tok_s = prefill(server, rng)
        finally:
            server.close()
        tiled_server = Server(args.checkpoint, work, environment={"DEEPINFER_MX_KERNEL": "tiled"})
        try:
            print("the dequantize-per-tile fallback (DEEPINFER_MX_KERNEL=tiled):", flush=True)
            tiled = measure(tiled_server, args.decode_tokens, rng)
        finally:
            tiled_server.close()
        # After the servers: their memory and this buffer need not fit together.
        bandwidth = read_bandwidth_gbs(threads)
        print(f"read bandwidth, {threads} threads: {bandwidth:.1f} GB/s", flush=True)
        dequantized = dequantized_figures(args, model, stored, work, rng)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    kv = KV_SPACE_GIB << 30
    step_bytes = {str(b): bytes_per_decode_step(model, stored, b) for b in BATCHES}
    results = {
        "layers": a.num_hidden_layers,
        "moe_layers": a.num_hidden_layers,
        "checkpoint_bytes": total,
        "engram_table_bytes": engram,
        "kv_cache_bytes": kv,
        "rss_bytes": {"after_load": after_load, "after_decode": after_decode},
        "memory_bandwidth_gbs": bandwidth,
        "bytes_read_per_decode_step": step_bytes,
        "decode_tok_s": decode,
        "bandwidth_fraction": {
            b: rate / int(b) * step_bytes[b] / 1e9 / bandwidth for b, rate in decode.items()
        },
        "tiled": {"decode_tok_s": tiled},
        "speedup_over_tiled": {b: decode[b] / tiled[b] for b in decode},
        "prefill_tok_s": {str(PREFILL_TOKENS): prefill_tok_s},
        "dequantized": dequantized,
    }
    print(json.dumps(results, indent=2))
    bound = 1.15 * (total - engram) + kv + (2 << 30)
    print(
        f"rss after decode {after_decode / 2**30:.2f} GiB, bound 1.15 x (checkpoint - "
        f"Engram) + KV + 2 GiB = {bound / 2**30:.2f} GiB: "
        f"{'met' if after_decode <= bound else 'missed'}"
    )
    for b in map(str, BATCHES):
        fraction = results["bandwidth_fraction"][b]
        print(
            f"decode at {b}: {fraction * bandwidth:.2f} GB/s read, {fraction:.1%} of the "
            f"bound; {results['speedup_over_tiled'][b]:.2f}x the tiled fallback"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        from plots import write_plot  # the PNG beside the JSON

        write_plot(
            args.json,
            f"Real-width V4.1-Flash slice ({a.num_hidden_layers} layers), bf16",
            {
                "GiB resident": {
                    "after load": {"server": after_load / 2**30},
                    "after decode": {"server": after_decode / 2**30},
                    "bound": {"server": bound / 2**30},
                },
                "tokens/s": {
                    f"decode {b}": {"kernel": decode[str(b)], "tiled": tiled[str(b)]}
                    for b in BATCHES
                },
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
