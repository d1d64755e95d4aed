"""Structured outputs: time to first token with the plugin's precompiled-grammar cache
against stock vLLM's compile-in-the-engine path, and the per-step cost of constrained
decoding against unconstrained decoding, side by side in one run.

    python benchmarks/structured_outputs.py --model checkpoints/tiny-v41-flash [--quick]

Two engines with the same settings live side by side: the plugin's (its xgrammar backend
behind the on-disk grammar cache, fed by GrammarCompilePool.compile_all in a worker
process) and a stock one, started with DEEPINFER_GRAMMAR_CACHE=off so its engine core
runs vLLM's own xgrammar backend, which compiles every grammar itself. The stock engine
points at a grammar cache directory of its own that must stay empty. Rounds interleave
every path on both engines (the order rotates each round) and every figure is the median
over the rounds. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid

from vllm_deepinfer import envs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fixtures/, tools/

DECODE_MODES = ("unconstrained", "plugin", "builtin_unconstrained", "builtin")
UNCONSTRAINED_MODES = ("unconstrained", "builtin_unconstrained")
STOCK_MODES = ("builtin_unconstrained", "builtin")  # run on the stock engine
PROMPT_IDS = (3, 800)  # token ids of the random prompts: [low, high)
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
SETTLE_S = 1.5  # a vLLM worker busy-polls for 1 s after its last step; let it go idle

# Time to first token: a realistic object schema (nested object, enum, pattern, bounded
# strings and array). Each cold request gets a never-seen enum value, so its JSON Schema
# string, and thus its compiled grammar, is new to every cache.
TTFT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Hangzhou", "Lima"]},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


def ttft_schema(tag: str) -> dict:
    schema = copy.deepcopy(TTFT_SCHEMA)
    schema["properties"]["address"]["properties"]["city"]["enum"].append(f"C{tag}")
    return schema


def decode_schema(tag: str, min_items: int) -> dict:
    """An array of at least `min_items` small objects: every item is 15+ characters that
    no single token covers, so no request can finish before its max_tokens."""
    return {
        "type": "array",
        "minItems": min_items,
        "maxItems": min_items + 8,
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 99},
                "ok": {"type": "boolean"},
                "tag": {"type": "string", "enum": ["red", "green", "blue", f"t{tag}"]},
            },
            "required": ["id", "ok", "tag"],
            "additionalProperties": False,
        },
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=None,
        help="tiny V4.1 checkpoint dir (written there if config.json is "
        "missing; default: a temporary directory)",
    )
    parser.add_argument(
        "--ttft-rounds",
        type=int,
        default=9,
        help="time-to-first-token measurements per path (median reported)",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--decode-tokens",
        type=int,
        default=48,
        help="decode steps measured per request (max_tokens = this + 1)",
    )
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument(
        "--decode-rounds",
        type=int,
        default=4,
        help="decode measurements per path and batch size (median reported)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, len(os.sched_getaffinity(0)) - 1),
        help="compute threads of the vLLM worker (default: all CPUs but one)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 TTFT rounds, batches 1 2, 8 decode steps, 1 round",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="also write the settings, checks and every measurement there"
    )
    args = parser.parse_args()
    if args.quick:
        args.ttft_rounds, args.batch_sizes = 2, [1, 2]
        args.decode_tokens, args.decode_rounds = 8, 1
    return args


def configure_env(threads: int) -> str:
    """Before vllm is imported: the KV cache size, log volume, and the workers' compute
    threads. Returns the workers' CPU ids."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    return cpus


class Bench:
    def __init__(self, args: argparse.Namespace, model: str, plugin_cache: str, stock_cache: str):
        from vllm_deepinfer.structured.compile_pool import GrammarCompilePool

        self.args, self.rng = args, random.Random(0)
        self.cache_dir, self.stock_cache_dir = plugin_cache, stock_cache
        with envs.overridden(
            DEEPINFER_GRAMMAR_CACHE="on", DEEPINFER_GRAMMAR_CACHE_DIR=plugin_cache
        ):
            self.llm = self.engine(model)
        with envs.overridden(
            DEEPINFER_GRAMMAR_CACHE="off", DEEPINFER_GRAMMAR_CACHE_DIR=stock_cache
        ):
            self.stock_llm = self.engine(model)
        self.pool = GrammarCompilePool(self.llm.llm_engine.vllm_config, self.cache_dir)
        self.engine_recompiled = 0  # plugin-path grammars the engine compiled anyway
        self.stock_grammars: set[str] = set()  # distinct grammars the stock engine compiled
        self.plugin_engine_stored = 0  # positive control, set by prepare_ttft

    def engine(self, model: str):
        from vllm import LLM

        max_batch = max(self.args.batch_sizes)
        return LLM(
            model=model,
            dtype="float32",
            enforce_eager=True,
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK_SIZE,
            max_num_seqs=max_batch,
            max_num_batched_tokens=max(max_batch * self.args.prompt_len, MAX_MODEL_LEN),
            enable_prefix_caching=False,
            seed=0,
            disable_log_stats=False,  # per-request engine timestamps (metrics)
            structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
        )

    # ------------------------------------------------------------------------ helpers

    def prompts(self, batch: int):
        from vllm.inputs import TokensPrompt

        return [
            TokensPrompt(
                prompt_token_ids=[
                    self.rng.randrange(*PROMPT_IDS) for _ in range(self.args.prompt_len)
                ]
            )
            for _ in range(batch)
        ]

    @staticmethod
    def params(schema: dict | None, max_tokens: int):
        from vllm_deepinfer.structured.so_args import sampling_params

        if schema is None:
            return sampling_params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return sampling_params(
            so_args={"schema_type": "json", "schema": schema},
            max_tokens=max_tokens,
            temperature=0.0,
        )

    def cache_files(self) -> dict[str, tuple[int, int]]:
        """The plugin engine's cache entry -> (inode, mtime): an entry the engine compiles
        again is rewritten (a new file renamed over the old one), so its inode changes."""
        entries = {}
        for name in os.listdir(self.cache_dir):
            if name.endswith(".json"):
                st = os.stat(os.path.join(self.cache_dir, name))
                entries[name] = (st.st_ino, st.st_mtime_ns)
        return entries

    def generate(self, prompts, params):
        return self.llm.generate(prompts, params, use_tqdm=False)

    def stock_generate(self, prompts, params):
        outputs = self.stock_llm.generate(prompts, params, use_tqdm=False)
        self.check_stock(params)
        return outputs

    def check_stock(self, params) -> None:
        """The stock engine's grammar cache directory is still empty: with the plugin's
        patch active there, its engine core would have stored every grammar it compiled."""
        for p in params if isinstance(params, list) else [params]:
            if p.structured_outputs is not None:
                self.stock_grammars.add(p.structured_outputs.grammar)
        stored = os.listdir(self.stock_cache_dir)
        assert not stored, f"the stock engine stored grammars {stored}: the patch is active"

    # ------------------------------------------------------------- time to first token

    def ttft(self, llm, params) -> float:
        prompts = self.prompts(1)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if llm is self.stock_llm:
            self.check_stock(params)
        return elapsed

    def ttft_unconstrained(self) -> float:
        return self.ttft(self.llm, self.params(None, 1))

    def ttft_builtin_unconstrained(self) -> float:
        return self.ttft(self.stock_llm, self.params(None, 1))

    def ttft_builtin_cold(self) -> float:
        """A never-seen schema on the stock engine: vLLM's backend compiles it."""
        return self.ttft(self.stock_llm, self.params(ttft_schema(uuid.uuid4().hex), 1))

    def ttft_builtin_repeat(self) -> float:
        """The schema the stock engine compiled during warm-up: answered from xgrammar's
        in-memory cache in vLLM's backend (stock vLLM's repeat case)."""
        return self.ttft(self.stock_llm, self.repeat_params)

    def ttft_plugin(self, params, expect_cached: bool) -> tuple[float, float]:
        """pool.compile_all, then generate; returns (total, compile_all) seconds."""
        prompts = self.prompts(1)
        start = time.perf_counter()
        (result,) = self.pool.compile_all([params])
        compiled = time.perf_counter()
        before = self.cache_files()
        self.generate(prompts, params)
        elapsed = time.perf_counter() - start
        assert result.cached == expect_cached, result
        if self.cache_files() != before:
            self.engine_recompiled += 1
        return elapsed, compiled - start

    def ttft_plugin_cold(self) -> tuple[float, float]:
        return self.ttft_plugin(self.params(ttft_schema(uuid.uuid4().hex), 1), False)

    def ttft_plugin_cached(self) -> tuple[float, float]:
        return self.ttft_plugin(self.cached_params, True)

    def prepare_ttft(self) -> None:
        """Warm-up of both engines and the pool, the positive control of the cache check
        (the plugin's engine stores a grammar it compiled itself), and the two fixed
        schemas: one precompiled by the pool (the plugin's cached case), one compiled by
        the stock engine (the built-in repeat case)."""
        self.generate(self.prompts(1), self.params(None, 1))
        self.stock_generate(self.prompts(1), self.params(None, 1))
        self.pool.compile_all([self.params(ttft_schema("warm-up-pool"), 1)])  # worker start
        before = set(self.cache_files())
        self.generate(self.prompts(1), self.params(ttft_schema("warm-up-engine"), 1))
        self.plugin_engine_stored = len(set(self.cache_files()) - before)
        assert self.plugin_engine_stored == 1, "the plugin's engine runs without its cache"
        self.stock_generate(self.prompts(1), self.params(ttft_schema("warm-up-engine"), 1))
        self.cached_params = self.params(ttft_schema("cached"), 1)
        assert not self.pool.compile_all([self.cached_params])[0].cached
        self.generate(self.prompts(1), self.cached_params)
        self.repeat_params = self.params(ttft_schema("repeat"), 1)
        self.stock_generate(self.prompts(1), self.repeat_params)
        time.sleep(SETTLE_S)

    def measure_ttft(self) -> dict[str, list[float]]:
        paths = [
            ("unconstrained", self.ttft_unconstrained),
            ("builtin_cold", self.ttft_builtin_cold),
            ("plugin_cold", self.ttft_plugin_cold),
            ("builtin_unconstrained", self.ttft_builtin_unconstrained),
            ("plugin_cached", self.ttft_plugin_cached),
            ("builtin_repeat", self.ttft_builtin_repeat),
        ]
        results: dict[str, list[float]] = {}
        for round_ in range(self.args.ttft_rounds):
            shift = round_ % len(paths)
            for name, fn in paths[shift:] + paths[:shift]:
                value = fn()
                if isinstance(value, tuple):
                    value, compile_s = value
                    results.setdefault(name + "_compile", []).append(compile_s)
                results.setdefault(name, []).append(value)
                time.sleep(SETTLE_S)
            print(f"  TTFT round {round_ + 1}/{self.args.ttft_rounds} done", flush=True)
        return results

    # --------------------------------------------------------------------------- decode

    def decode_step_s(self, batch: int, mode: str) -> float:
        """Median over the B requests of (last token time - first token time) / steps,
        from the engine's own per-request timestamps: grammar compilation and prefill
        come before the first token and are not in it."""
        steps = self.args.decode_tokens
        if mode in UNCONSTRAINED_MODES:
            params = self.params(None, steps + 1)
        else:
            params = self.params(decode_schema(uuid.uuid4().hex, steps), steps + 1)
            if mode == "plugin":
                assert not self.pool.compile_all([params])[0].cached
        before = self.cache_files()
        generate = self.stock_generate if mode in STOCK_MODES else self.generate
        outputs = generate(self.prompts(batch), [params] * batch)
        if mode == "plugin" and self.cache_files() != before:
            self.engine_recompiled += 1
        per_request = []
        for output in outputs:
            completion, metrics = output.outputs[0], output.metrics
            assert len(completion.token_ids) == steps + 1, (mode, completion)
            assert completion.finish_reason == "length", (mode, completion.text)
            per_request.append((metrics.last_token_ts - metrics.first_token_ts) / steps)
        return statistics.median(per_request)

    def measure_decode(self) -> dict[tuple[str, int], list[float]]:
        for mode in DECODE_MODES:  # warm-up at the largest batch, unrecorded
            self.decode_step_s(max(self.args.batch_sizes), mode)
        time.sleep(SETTLE_S)
        results: dict[tuple[str, int], list[float]] = {}
        for round_ in range(self.args.decode_rounds):
            start = time.perf_counter()
            for batch in self.args.batch_sizes:
                shift = (round_ + batch) % len(DECODE_MODES)
                for mode in DECODE_MODES[shift:] + DECODE_MODES[:shift]:
                    results.setdefault((mode, batch), []).append(self.decode_step_s(batch, mode))
                    time.sleep(SETTLE_S)
            print(
                f"  decode round {round_ + 1}/{self.args.decode_rounds} took "
                f"{time.perf_counter() - start:.0f} s",
                flush=True,
            )
        return results

    def checks(self) -> dict:
        """What shows that the built-in figures come from stock vLLM, and that the plugin's
        figures come from its cache."""
        return {
            "stock_engine_grammars_compiled": len(self.stock_grammars),
            "stock_engine_cache_files": len(os.listdir(self.stock_cache_dir)),
            "plugin_engine_stored_own_compile": self.plugin_engine_stored,
            "plugin_grammars_recompiled_by_engine": self.engine_recompiled,
        }

    def close(self) -> None:
        self.pool.shutdown()
        for llm in (self.llm, self.stock_llm):
            llm.llm_engine.engine_core.shutdown()
        del self.llm, self.stock_llm
        gc.collect()


# ------------------------------------------------------------------------------ reporting


def med(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> str:
    """Half the range, relative to the median."""
    return f"±{(max(values) - min(values)) / 2 / med(values):4.0%}"


TTFT_ROWS = (  # key, label, the same engine's unconstrained key, how
    (
        "unconstrained",
        "plugin, unconstrained",
        "unconstrained",
        "plugin's engine: generate, no constraint",
    ),
    (
        "plugin_cold",
        "plugin, cold",
        "unconstrained",
        "pool.compile_all (compiles) + generate (loads)",
    ),
    (
        "plugin_cached",
        "plugin, precompiled",
        "unconstrained",
        "pool.compile_all (cache hit) + generate (loads)",
    ),
    (
        "builtin_unconstrained",
        "stock, unconstrained",
        "builtin_unconstrained",
        "stock engine: generate, no constraint",
    ),
    (
        "builtin_cold",
        "stock vLLM, cold",
        "builtin_unconstrained",
        "generate; vLLM's backend compiles the new schema",
    ),
    (
        "builtin_repeat",
        "stock vLLM, repeat",
        "builtin_unconstrained",
        "generate; xgrammar in-memory cache hit",
    ),
)


def report_ttft(r: dict[str, list[float]]) -> str:
    cold = med(r["builtin_cold"])
    lines = [
        f"{'path':<22} {'TTFT ms':>14} {'of which pool':>14} {'- unconstr.':>12}"
        f" {'vs stock cold':>14}   how"
    ]
    for key, label, floor, how in TTFT_ROWS:
        m = med(r[key])
        pool = f"{med(r[key + '_compile']) * 1e3:10.1f} ms" if key + "_compile" in r else ""
        lines.append(
            f"{label:<22} {m * 1e3:8.1f} {spread(r[key])} {pool:>14} "
            f"{(m - med(r[floor])) * 1e3:+9.1f} ms {m / cold:>13.2f}x   {how}"
        )
    return "\n".join(lines)


def report_decode(r: dict[tuple[str, int], list[float]], batch_sizes: list[int]) -> str:
    labels = {
        "unconstrained": "plugin, unconstr.",
        "plugin": "plugin, precompiled",
        "builtin_unconstrained": "stock, unconstr.",
        "builtin": "stock vLLM",
    }
    head = " ".join(f"{labels[mode]:>22}" for mode in DECODE_MODES)
    unit = " ".join(f"{'ms/step':>9} {'':>5} {'tok/s':>6}" for _ in DECODE_MODES)
    lines = [f"{'batch':>5} {head} {'plugin/unc.':>11} {'stock/unc.':>11}", f"{'':>5} {unit}"]
    for b in batch_sizes:
        cells, medians = [], {}
        for mode in DECODE_MODES:
            values = r[(mode, b)]
            medians[mode] = med(values)
            cells.append(f"{medians[mode] * 1e3:9.2f} {spread(values)} {b / medians[mode]:6.0f}")
        lines.append(
            f"{b:>5} "
            + " ".join(cells)
            + f" {medians['plugin'] / medians['unconstrained']:>10.2f}x"
            + f" {medians['builtin'] / medians['builtin_unconstrained']:>10.2f}x"
        )
    return "\n".join(lines)


def summary(values: list[float]) -> dict:
    return {"median_ms": med(values) * 1e3, "values_ms": [v * 1e3 for v in values]}


def write_json(
    path: str,
    args: argparse.Namespace,
    model: str,
    cpus: str,
    checks: dict,
    ttft: dict[str, list[float]],
    decode: dict[tuple[str, int], list[float]],
):
    result = {
        "settings": {
            "model": model,
            "cpus": cpus,
            "threads": args.threads,
            "ttft_rounds": args.ttft_rounds,
            "batch_sizes": args.batch_sizes,
            "decode_tokens": args.decode_tokens,
            "prompt_len": args.prompt_len,
            "decode_rounds": args.decode_rounds,
        },
        "checks": checks,
        "ttft": {key: summary(values) for key, values in ttft.items()},
        "decode_step": {
            mode: {
                str(b): {**summary(decode[(mode, b)]), "tok_s": b / med(decode[(mode, b)])}
                for b in args.batch_sizes
            }
            for mode in DECODE_MODES
        },
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    from plots import write_plot  # the PNG beside the JSON

    ms = {key: value["median_ms"] for key, value in result["ttft"].items()}
    write_plot(
        path,
        "Structured outputs: the plugin's grammar cache vs stock vLLM",
        {
            "time to first token, ms": {
                "plugin's engine": {
                    "unconstrained": ms.get("unconstrained"),
                    "cold": ms.get("plugin_cold"),
                    "precompiled / repeat": ms.get("plugin_cached"),
                },
                "stock engine": {
                    "unconstrained": ms.get("builtin_unconstrained"),
                    "cold": ms.get("builtin_cold"),
                    "precompiled / repeat": ms.get("builtin_repeat"),
                },
            },
            "decode tokens/s": {
                f"batch {b}": {
                    mode: result["decode_step"][mode][str(b)]["tok_s"] for mode in DECODE_MODES
                }
                for b in args.batch_sizes
            },
        },
    )


def main() -> None:
    args = parse_args()
    from vllm_deepinfer.preload import reexec_with_preloads

    reexec_with_preloads()  # tcmalloc and Intel's OpenMP, as vLLM's CPU guide asks
    cpus = configure_env(args.threads)
    plugin_cache = tempfile.mkdtemp(prefix="so-bench-grammars-")
    stock_cache = tempfile.mkdtemp(prefix="so-bench-stock-grammars-")
    model_tmp = None
    model = args.model
    if model is None:
        model = model_tmp = tempfile.mkdtemp(prefix="tiny-v41-")
    from fixtures.tiny import ensure_checkpoint

    ensure_checkpoint(model)
    print(
        f"Model {model} (fp32, eager, block size {BLOCK_SIZE}); two engines, each with its "
        f"vLLM worker on CPU {cpus} ({args.threads} thread(s)); xgrammar backend, "
        f"disable_any_whitespace. Plugin's engine: fresh grammar cache {plugin_cache}. "
        f"Stock engine: DEEPINFER_GRAMMAR_CACHE=off, cache dir {stock_cache} (must stay "
        "empty).",
        flush=True,
    )
    start = time.perf_counter()
    bench = Bench(args, model, plugin_cache, stock_cache)
    try:
        print("Warming up ...", flush=True)
        bench.prepare_ttft()
        ttft = bench.measure_ttft()
        decode = bench.measure_decode()
        checks = bench.checks()
    finally:
        bench.close()
        shutil.rmtree(plugin_cache, ignore_errors=True)
        shutil.rmtree(stock_cache, ignore_errors=True)
        if model_tmp:
            shutil.rmtree(model_tmp, ignore_errors=True)
    print(f"\n(total {time.perf_counter() - start:.0f} s)\n")
    print(
        "\n\n".join(
            [
                "Stock engine: its engine core started with DEEPINFER_GRAMMAR_CACHE=off compiled "
                f"{checks['stock_engine_grammars_compiled']} distinct grammars and stored "
                f"{checks['stock_engine_cache_files']} cache files (the plugin's patch stores every "
                "grammar it compiles: it is not active there). Plugin's engine: stored "
                f"{checks['plugin_engine_stored_own_compile']} grammar it compiled itself during "
                "warm-up (its patch is active).",
                f"Time to first token: wall time of LLM.generate of ONE request (prompt of "
                f"{args.prompt_len} random ids, max_tokens=1), plus pool.compile_all where named; "
                f"median of {args.ttft_rounds} rounds, ± half the range; '- unconstr.' subtracts "
                "the same engine's unconstrained time. Cold: a JSON Schema never seen before (a "
                "fresh enum value each round); precompiled/repeat: the same schema every round.",
                report_ttft(ttft),
                f"Decode: B requests, prompts of {args.prompt_len} random ids, {args.decode_tokens} "
                "decode steps each (max_tokens="
                f"{args.decode_tokens + 1}, all end by length); ms/step = (last - first token time)"
                f" / {args.decode_tokens} from the engine's per-request timestamps (median over the"
                f" B requests, then over {args.decode_rounds} rounds, ± half the range); tok/s = "
                "B / ms/step. Constrained: a JSON Schema array of >= "
                f"{args.decode_tokens} small objects, a fresh schema every run (plugin: compiled "
                "by the pool first; stock: compiled by vLLM's backend in the engine). "
                "Unconstrained: ignore_eos=True. Ratios are to the same engine's unconstrained.",
                report_decode(decode, args.batch_sizes),
                "Constrained decoding is the same code path for both: the plugin changes only where "
                "the grammar comes from (deserialized from disk instead of compiled); every step "
                "then runs vLLM's own xgrammar matcher (bitmask fill, logits masking, accept). "
                "Plugin-path grammars the engine compiled again instead of loading: "
                f"{checks['plugin_grammars_recompiled_by_engine']}.",
            ]
        )
    )
    if args.json:
        write_json(args.json, args, model, cpus, checks, ttft, decode)
        print(f"\nWrote {args.json}")


if __name__ == "__main__":
    main()
