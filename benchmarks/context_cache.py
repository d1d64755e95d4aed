"""Context caching on disk (vllm_deepinfer/context_cache/), measured side by side in one run
on the plugin's V4.1 in fp32 on the CPU:

- time to first token of a prompt of 1k and 16k tokens: cold (a fresh prompt on an engine
  with a context cache directory), a memory hit (the same prompt again on the same engine:
  vLLM's local prefix cache) and a disk hit after a restart (the engine closed, a new one
  started on the same directory, the same prompt: its global KV loaded from the files);
- bytes on disk per token of the global KV blocks written (files with their headers), in
  fp32 and at the release's precisions (NVFP4 latents, MXFP4 index keys), against the
  formula `kv_cache/precision.py` `persisted_bytes_per_token`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fixtures/, tools/

KEEP = 140
LENGTHS = (1024, 16384)
BYTES_PROMPT = 1024
"""Tokens of the prompt the release-precision engine writes for its bytes per token."""
KV_SPACE_BYTES = 4 << 30
"""KV space of an engine for 16k-token prompts (as benchmarks/replay.py); shorter runs get
a share of it, at least MIN_KV_SPACE_BYTES."""
MIN_KV_SPACE_BYTES = 512 << 20
WARM_UP = 4096
"""Tokens of the untimed first prompt of each engine (at most the longest length): one
prefill chunk (`max_num_batched_tokens`), so the first timed prompt pays no first-forward
costs at these sizes."""
RELEASE_PRECISIONS = {
    "kv_cache_dtype": "nvfp4_ds_mla",
    "attention_config": {"indexer_kv_dtype": "mxfp4"},
}


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
        default=list(LENGTHS),
        help="prompt lengths in tokens (default 1024 16384; smaller for a "
        "smoke run: the JSON is keyed by these)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="distinct prompts per length (median)"
    )
    parser.add_argument(
        "--cache-dir",
        help="the context cache directory (default: a fresh "
        "temporary one, removed at the end); it should start empty",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no torch.compile (a faster start, for smoke runs)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the issue's keys to PATH")
    args = parser.parse_args()
    if min(args.lengths) <= KEEP + 16:
        # Bounded replay recomputes the last KEEP tokens of a hit: a shorter one is none.
        parser.error(f"--lengths must exceed {KEEP + 16} tokens (keep {KEEP} + one block)")
    return args


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 800) for _ in range(length)]


class Engine:
    """One in-process vLLM engine with the context cache on `directory`."""

    def __init__(self, model: str, directory: str, max_len: int, enforce_eager: bool, **options):
        from vllm import LLM

        from vllm_deepinfer import envs

        settings = dict(
            model=model,
            dtype="float32",
            block_size=16,
            seed=0,
            kv_cache_memory_bytes=max(MIN_KV_SPACE_BYTES, KV_SPACE_BYTES * max_len // max(LENGTHS)),
            max_model_len=max_len + 16,
            max_num_batched_tokens=4096,
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            enforce_eager=enforce_eager,
            disable_log_stats=False,
        )  # RequestOutput.metrics: time to 1st token
        settings.update(options)
        with envs.overridden(
            DEEPINFER_CONTEXT_CACHE_DIR=directory, DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=str(KEEP)
        ):
            self.llm = LLM(**settings)

    def ttft_s(self, prompt_ids: list[int], min_cached: int = 0) -> float:
        """Seconds from the request's arrival to its first token (vLLM's
        `RequestOutput.metrics.first_token_latency`; the wall time of `generate` where the
        metrics are missing). Sets `cached` to the request's `num_cached_tokens`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        start = time.perf_counter()
        (output,) = self.llm.generate(
            [TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False
        )
        wall = time.perf_counter() - start
        self.cached = output.num_cached_tokens or 0
        if self.cached < min_cached:
            raise RuntimeError(f"found {self.cached} tokens cached, expected {min_cached}")
        latency = getattr(output.metrics, "first_token_latency", 0.0) or 0.0
        self.timed_by = "metrics" if latency > 0 else "wall"
        # Untimed: the connector's stores of this request (to the host tier at the next
        # step, then to disk) would otherwise run inside the next request's time.
        self.drain()
        return latency if latency > 0 else wall

    def drain(self, timeout_s: float = 120.0) -> None:
        """Steps the engine until its connector has no work left. `LLM.generate` stops
        stepping once its requests are done, but the connector stores a finished
        request's last blocks at the next step and the host tier hands blocks to the disk
        tier over later steps; a server's engine loop keeps stepping while there is such
        work (`Scheduler.has_requests`), an offline engine closed at once loses it."""
        core = self.llm.llm_engine.engine_core.engine_core
        deadline = time.monotonic() + timeout_s
        while core.scheduler.has_requests():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the context cache kept working for {timeout_s} s")
            self.llm.llm_engine.step()
            time.sleep(0.01)

    def close(self) -> None:
        """Stops the engine, what it stored being on disk (tests/helpers.py close_llm)."""
        import gc

        self.drain()
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


def disk_usage(directory: str, prompt_lengths: list[int]) -> dict:
    """The block files under `directory` (one layout expected): how many, their bytes
    (headers included) and the tokens they cover (each file: one chunk of
    `blocks_per_chunk` blocks of `tokens_per_hash` tokens, as its layout.json says), and
    the whole chunks of the prompts written (`prompt_lengths`), which they should equal."""
    layouts = glob.glob(os.path.join(directory, "deepinfer-*", "layout.json"))
    if len(layouts) != 1:
        raise RuntimeError(f"{directory} holds {len(layouts)} layouts, expected one")
    with open(layouts[0]) as f:
        layout = json.load(f)
    files = glob.glob(os.path.join(os.path.dirname(layouts[0]), "**", "*.bin"), recursive=True)
    tokens_per_file = layout["tokens_per_hash"] * layout["blocks_per_chunk"]
    total = sum(os.path.getsize(path) for path in files)
    return {
        "files": len(files),
        "bytes": total,
        "tokens": len(files) * tokens_per_file,
        "prompt_tokens": sum(n // tokens_per_file * tokens_per_file for n in prompt_lengths),
        "tokens_per_file": tokens_per_file,
        "payload_bytes": layout["payload_bytes"],
    }


def measure_ttft(args, directory: str, rng: random.Random) -> tuple[dict, dict]:
    """Cold and memory-hit times on one engine, then disk-hit times on a second engine on
    the same directory; also the first engine's files (fp32 bytes per token)."""
    lengths = args.lengths
    prompts = {length: [prompt(rng, length) for _ in range(args.rounds)] for length in lengths}
    times = {
        kind: {length: [] for length in lengths}
        for kind in ("cold", "memory_hit", "disk_hit_after_restart")
    }
    warm_up = min(WARM_UP, max(lengths))
    engine = Engine(args.model, directory, max(lengths), args.enforce_eager)
    try:
        engine.ttft_s(prompt(rng, warm_up))  # untimed
        for round_prompts in zip(*prompts.values()):
            for length, ids in zip(lengths, round_prompts):
                times["cold"][length].append(engine.ttft_s(ids))
                if engine.cached:
                    raise RuntimeError(
                        f"a fresh {length}-token prompt found {engine.cached} tokens cached"
                    )
                times["memory_hit"][length].append(engine.ttft_s(ids, min_cached=1))
                print(
                    f"  {length} tokens: cold {times['cold'][length][-1]:.3f} s, memory "
                    f"hit {times['memory_hit'][length][-1]:.3f} s ({engine.cached} "
                    "cached)",
                    flush=True,
                )
    finally:
        engine.close()  # a restart: what the engine stored is on disk
    usage = disk_usage(directory, [warm_up] + lengths * args.rounds)
    engine = Engine(args.model, directory, max(lengths), args.enforce_eager)
    try:
        engine.ttft_s(prompt(rng, warm_up))  # untimed, a fresh prompt: nothing to load
        for round_prompts in zip(*prompts.values()):
            for length, ids in zip(lengths, round_prompts):
                # Every whole file of the prompt but the last token's (vLLM recomputes it).
                expected = (length - 1) // usage["tokens_per_file"] * usage["tokens_per_file"]
                times["disk_hit_after_restart"][length].append(
                    engine.ttft_s(ids, min_cached=max(1, expected))
                )
                print(
                    f"  {length} tokens: disk hit after restart "
                    f"{times['disk_hit_after_restart'][length][-1]:.3f} s "
                    f"({engine.cached} cached)",
                    flush=True,
                )
    finally:
        engine.close()
    medians = {
        kind: {str(length): statistics.median(values) for length, values in by_length.items()}
        for kind, by_length in times.items()
    }
    print(
        "  times to first token: "
        + (
            "RequestOutput.metrics.first_token_latency"
            if engine.timed_by == "metrics"
            else "wall time of LLM.generate (no request metrics)"
        ),
        flush=True,
    )
    return medians, usage


def measure_release_bytes(args, directory: str, rng: random.Random) -> dict:
    """The files one prompt leaves with the release's global KV precisions."""
    length = min(BYTES_PROMPT, max(args.lengths))
    engine = Engine(args.model, directory, length, args.enforce_eager, **RELEASE_PRECISIONS)
    try:
        engine.ttft_s(prompt(rng, length))
    finally:
        engine.close()
    return disk_usage(directory, [length])


def formula_bytes(model_args) -> dict:
    from vllm_deepinfer.kv_cache.precision import (
        MXFP4_INDEX_KEY,
        NVFP4_LATENT,
        persisted_bytes_per_token,
    )

    # The release precisions as benchmarks/replay.py counts them (the formula's model
    # dtype then only sizes unquantized vectors: there are none).
    return {
        "tiny": persisted_bytes_per_token(model_args, None, None, 4),
        "tiny_release_precisions": persisted_bytes_per_token(
            model_args, NVFP4_LATENT, MXFP4_INDEX_KEY, 2
        ),
    }


def main() -> int:
    args = parse_args()
    from vllm_deepinfer.preload import reexec_with_preloads

    reexec_with_preloads()  # tcmalloc and Intel's OpenMP, as vLLM's CPU guide asks
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # drain() steps the engine in-process
    # Each engine's KV space is set here; vLLM's CPU platform would let this override it.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from fixtures.reference import read_checkpoint
    from fixtures.tiny import write_checkpoint

    if not os.path.exists(os.path.join(args.model, "config.json")):
        write_checkpoint(args.model)
    model_args, _ = read_checkpoint(args.model)
    root = args.cache_dir or tempfile.mkdtemp(prefix="deepinfer-context-cache-")
    fp32_dir, release_dir = os.path.join(root, "fp32"), os.path.join(root, "release")
    for directory in (fp32_dir, release_dir):
        if os.path.exists(directory) and os.listdir(directory):
            raise SystemExit(f"{directory} is not empty: a benchmark needs a fresh cache")
        os.makedirs(directory, exist_ok=True)
    rng = random.Random(0)
    try:
        ttft, fp32 = measure_ttft(args, fp32_dir, rng)
        release = measure_release_bytes(args, release_dir, rng)
    finally:
        if not args.cache_dir:
            shutil.rmtree(root, ignore_errors=True)

    usage = {"tiny": fp32, "tiny_release_precisions": release}
    results = {
        "ttft_s": ttft,
        "disk_bytes_per_token": {name: u["bytes"] / u["tokens"] for name, u in usage.items()},
        "formula_bytes_per_token": formula_bytes(model_args),
    }
    print(json.dumps(results, indent=2))
    for name, u in usage.items():
        disk, formula = (
            results["disk_bytes_per_token"][name],
            results["formula_bytes_per_token"][name],
        )
        print(
            f"{name}: {u['files']} files of {u['tokens_per_file']} tokens ({u['tokens']} "
            f"tokens; the prompts' whole blocks: {u['prompt_tokens']}), {u['bytes']} bytes "
            f"({u['payload_bytes']}-byte payloads, of which the formula's global KV is "
            f"{formula * u['tokens_per_file']:.0f}, + 64-byte headers) -> {disk:.1f} "
            f"B/token on disk, formula {formula:.1f} ({disk / formula - 1:+.1%}; target "
            "within 10%)"
        )
    longest = str(max(args.lengths))
    cold, memory, disk = (
        ttft[kind][longest] for kind in ("cold", "memory_hit", "disk_hit_after_restart")
    )
    print(
        f"time to first token at {longest} tokens: cold {cold:.3f} s, memory hit "
        f"{memory:.3f} s, disk hit after restart {disk:.3f} s; disk hit / cold "
        f"{disk / cold:.3f} (target <= 0.2)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        from plots import write_plot  # the PNG beside the JSON

        write_plot(
            args.json,
            "Context cache on disk: time to first token",
            {
                "seconds": {
                    f"{n} tokens": {kind: ttft[kind][n] for kind in ttft} for n in ttft["cold"]
                }
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
