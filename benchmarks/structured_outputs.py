"""Structured outputs: time to first token with the plugin's precompiled-grammar cache
against vLLM's built-in compile-in-the-engine path, and the per-step cost of constrained
decoding against unconstrained decoding, side by side in one run.

    python benchmarks/structured_outputs.py --model checkpoints/tiny-v41-flash [--quick]

One engine serves every path: the plugin's patched xgrammar backend reads the on-disk
grammar cache first and, on a miss, compiles exactly like stock vLLM. The plugin's path
is GrammarCompilePool.compile_all (a separate worker process) followed by generate; the
built-in path is generate alone. Rounds interleave every path (the order rotates each
round) and every figure is the median over the rounds. See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import random
import shutil
import statistics
import tempfile
import time
import uuid

PROMPT_IDS = (3, 800)  # token ids of the random prompts: [low, high)
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
SETTLE_S = 1.5  # a vLLM worker busy-polls for 1 s after its last step; let it go idle

# Time to first token: a realistic object schema (nested object, enum, pattern, bounded
# strings and array). Each cold request gets a never-seen enum value, so its JSON Schema
# string, and thus its compiled grammar, is new to every cache.
TTFT_SCHEMA = {
    "type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Hangzhou", "Lima"]},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}


def ttft_schema(tag: str) -> dict:
    schema = copy.deepcopy(TTFT_SCHEMA)
    schema["properties"]["address"]["properties"]["city"]["enum"].append(f"C{tag}")
    return schema


def decode_schema(tag: str, min_items: int) -> dict:
    """An array of at least `min_items` small objects: every item is 15+ characters that
    no single token covers, so no request can finish before its max_tokens."""
    return {
        "type": "array", "minItems": min_items, "maxItems": min_items + 8,
        "items": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
            "tag": {"type": "string", "enum": ["red", "green", "blue", f"t{tag}"]}},
            "required": ["id", "ok", "tag"], "additionalProperties": False}}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="tiny V4.1 checkpoint dir (written there if config.json is "
                             "missing; default: a temporary directory)")
    parser.add_argument("--ttft-rounds", type=int, default=9,
                        help="time-to-first-token measurements per path (median reported)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--decode-tokens", type=int, default=48,
                        help="decode steps measured per request (max_tokens = this + 1)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--decode-rounds", type=int, default=4,
                        help="decode measurements per path and batch size (median reported)")
    parser.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1),
                        help="compute threads of the vLLM worker (default: all CPUs but one)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 TTFT rounds, batches 1 2, 8 decode steps, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.ttft_rounds, args.batch_sizes = 2, [1, 2]
        args.decode_tokens, args.decode_rounds = 8, 1
    return args


def configure_env(threads: int) -> str:
    """Before vllm is imported: a fresh grammar cache (shared by this process, the engine
    and the compile worker, and removed at the end), the KV cache size, log volume, and
    the worker's compute threads. Returns the worker's CPU ids."""
    os.environ["DEEPINFER_GRAMMAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="so-bench-grammars-")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    return cpus


class Bench:
    def __init__(self, args: argparse.Namespace, model: str):
        from vllm import LLM

        from vllm_deepinfer import envs
        from vllm_deepinfer.structured.compile_pool import GrammarCompilePool

        self.args, self.rng = args, random.Random(0)
        self.cache_dir = envs.load().grammar_cache_dir
        max_batch = max(args.batch_sizes)
        self.llm = LLM(model=model, dtype="float32", enforce_eager=True,
                       max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                       max_num_seqs=max_batch,
                       max_num_batched_tokens=max(max_batch * args.prompt_len, MAX_MODEL_LEN),
                       enable_prefix_caching=False, seed=0,
                       disable_log_stats=False,  # per-request engine timestamps (metrics)
                       structured_outputs_config={"backend": "xgrammar",
                                                  "disable_any_whitespace": True})
        self.pool = GrammarCompilePool(self.llm.llm_engine.vllm_config, self.cache_dir)
        self.engine_recompiled = 0  # plugin-path grammars the engine compiled anyway

    # ------------------------------------------------------------------------ helpers

    def prompts(self, batch: int):
        from vllm.inputs import TokensPrompt

        return [TokensPrompt(prompt_token_ids=[self.rng.randrange(*PROMPT_IDS)
                                               for _ in range(self.args.prompt_len)])
                for _ in range(batch)]

    @staticmethod
    def params(schema: dict | None, max_tokens: int):
        from vllm_deepinfer.structured.so_args import sampling_params

        if schema is None:
            return sampling_params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return sampling_params(so_args={"schema_type": "json", "schema": schema},
                               max_tokens=max_tokens, temperature=0.0)

    def cache_files(self) -> dict[str, tuple[int, int]]:
        """Cache entry -> (inode, mtime): an entry the engine compiles again is rewritten
        (a new file renamed over the old one), so its inode changes."""
        entries = {}
        for name in os.listdir(self.cache_dir):
            if name.endswith(".json"):
                st = os.stat(os.path.join(self.cache_dir, name))
                entries[name] = (st.st_ino, st.st_mtime_ns)
        return entries

    def generate(self, prompts, params):
        return self.llm.generate(prompts, params, use_tqdm=False)

    # ------------------------------------------------------------- time to first token

    def ttft_unconstrained(self) -> float:
        prompts, params = self.prompts(1), self.params(None, 1)
        start = time.perf_counter()
        self.generate(prompts, params)
        return time.perf_counter() - start

    def ttft_builtin_cold(self) -> float:
        """A never-seen schema, no pool call: the engine's backend misses the disk cache
        (one failed file lookup) and compiles it itself, like stock vLLM."""
        prompts, params = self.prompts(1), self.params(ttft_schema(uuid.uuid4().hex), 1)
        before = self.cache_files()
        start = time.perf_counter()
        self.generate(prompts, params)
        elapsed = time.perf_counter() - start
        assert len(self.cache_files()) == len(before) + 1, "the engine did not compile"
        return elapsed

    def ttft_plugin(self, params, expect_cached: bool) -> tuple[float, float]:
        """pool.compile_all, then generate; returns (total, compile_all) seconds."""
        prompts = self.prompts(1)
        start = time.perf_counter()
        result, = self.pool.compile_all([params])
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

    def ttft_builtin_repeat(self) -> float:
        """The schema this engine compiled before: its cache file is deleted first, so the
        plugin's lookup misses and vLLM's own compiler answers from xgrammar's in-memory
        cache (stock vLLM's repeat case; plus the plugin's write-back of the file)."""
        for name in self.repeat_files:
            os.remove(os.path.join(self.cache_dir, name))
        prompts = self.prompts(1)
        start = time.perf_counter()
        self.generate(prompts, self.repeat_params)
        return time.perf_counter() - start

    def prepare_ttft(self) -> None:
        """Warm-up and the two fixed schemas: one precompiled by the pool (the plugin's
        cached case), one compiled by the engine itself (the built-in repeat case)."""
        self.generate(self.prompts(1), self.params(None, 1))
        self.pool.compile_all([self.params(ttft_schema("warm-up-pool"), 1)])  # worker start
        self.generate(self.prompts(1), self.params(ttft_schema("warm-up-engine"), 1))
        self.cached_params = self.params(ttft_schema("cached"), 1)
        assert not self.pool.compile_all([self.cached_params])[0].cached
        self.generate(self.prompts(1), self.cached_params)
        before = set(self.cache_files())
        self.repeat_params = self.params(ttft_schema("repeat"), 1)
        self.generate(self.prompts(1), self.repeat_params)
        self.repeat_files = set(self.cache_files()) - before
        assert len(self.repeat_files) == 1, self.repeat_files
        time.sleep(SETTLE_S)

    def measure_ttft(self) -> dict[str, list[float]]:
        paths = [("unconstrained", self.ttft_unconstrained),
                 ("builtin_cold", self.ttft_builtin_cold),
                 ("plugin_cold", self.ttft_plugin_cold),
                 ("plugin_cached", self.ttft_plugin_cached),
                 ("builtin_repeat", self.ttft_builtin_repeat)]
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
        if mode == "unconstrained":
            params = self.params(None, steps + 1)
        else:
            params = self.params(decode_schema(uuid.uuid4().hex, steps), steps + 1)
            if mode == "plugin":
                assert not self.pool.compile_all([params])[0].cached
        before = self.cache_files()
        outputs = self.generate(self.prompts(batch), [params] * batch)
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
        modes = ["unconstrained", "plugin", "builtin"]
        for mode in modes:  # warm-up at the largest batch, unrecorded
            self.decode_step_s(max(self.args.batch_sizes), mode)
        time.sleep(SETTLE_S)
        results: dict[tuple[str, int], list[float]] = {}
        for round_ in range(self.args.decode_rounds):
            start = time.perf_counter()
            for batch in self.args.batch_sizes:
                shift = (round_ + batch) % len(modes)
                for mode in modes[shift:] + modes[:shift]:
                    results.setdefault((mode, batch), []).append(
                        self.decode_step_s(batch, mode))
                    time.sleep(SETTLE_S)
            print(f"  decode round {round_ + 1}/{self.args.decode_rounds} took "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
        return results

    def close(self) -> None:
        self.pool.shutdown()
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


# ------------------------------------------------------------------------------ reporting

def med(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> str:
    """Half the range, relative to the median."""
    return f"±{(max(values) - min(values)) / 2 / med(values):4.0%}"


def report_ttft(r: dict[str, list[float]], rounds: int) -> str:
    rows = [
        ("unconstrained", "unconstrained", "generate, no constraint"),
        ("builtin_cold", "vLLM built-in, cold", "generate; the engine compiles the new schema"),
        ("plugin_cold", "plugin, cold", "pool.compile_all (compiles) + generate (loads)"),
        ("plugin_cached", "plugin, precompiled", "pool.compile_all (cache hit) + generate (loads)"),
        ("builtin_repeat", "vLLM built-in, repeat", "generate; xgrammar in-memory cache hit"),
    ]
    base, cold = med(r["unconstrained"]), med(r["builtin_cold"])
    lines = [f"{'path':<23} {'TTFT ms':>14} {'of which pool':>14} {'- unconstr.':>12}"
             f" {'vs built-in cold':>17}   how"]
    for key, label, how in rows:
        m = med(r[key])
        pool = f"{med(r[key + '_compile']) * 1e3:10.1f} ms" if key + "_compile" in r else ""
        lines.append(f"{label:<23} {m * 1e3:8.1f} {spread(r[key])} {pool:>14} "
                     f"{(m - base) * 1e3:+9.1f} ms {m / cold:>16.2f}x   {how}")
    return "\n".join(lines)


def report_decode(r: dict[tuple[str, int], list[float]], batch_sizes: list[int]) -> str:
    lines = [f"{'batch':>5} {'unconstrained':>22} {'plugin (precompiled)':>22} "
             f"{'built-in (in engine)':>22} {'plugin/unc.':>11} {'built-in/unc.':>13}",
             f"{'':>5} {'ms/step':>9} {'':>5} {'tok/s':>6} {'ms/step':>9} {'':>5} {'tok/s':>6}"
             f" {'ms/step':>9} {'':>5} {'tok/s':>6}"]
    for b in batch_sizes:
        cells, medians = [], {}
        for mode in ("unconstrained", "plugin", "builtin"):
            values = r[(mode, b)]
            medians[mode] = med(values)
            cells.append(f"{medians[mode] * 1e3:9.2f} {spread(values)} {b / medians[mode]:6.0f}")
        lines.append(f"{b:>5} " + " ".join(cells)
                     + f" {medians['plugin'] / medians['unconstrained']:>10.2f}x"
                     + f" {medians['builtin'] / medians['unconstrained']:>12.2f}x")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    cpus = configure_env(args.threads)
    cache_dir = os.environ["DEEPINFER_GRAMMAR_CACHE_DIR"]
    model_tmp = None
    model = args.model
    if model is None:
        model = model_tmp = tempfile.mkdtemp(prefix="tiny-v41-")
    from vllm_deepinfer.checkpoint.tiny import ensure_checkpoint

    ensure_checkpoint(model)
    print(f"Model {model} (fp32, eager, block size {BLOCK_SIZE}); vLLM worker on CPU {cpus} "
          f"({args.threads} thread(s)); xgrammar backend, disable_any_whitespace; fresh "
          f"grammar cache {cache_dir}.", flush=True)
    start = time.perf_counter()
    bench = Bench(args, model)
    try:
        print("Warming up ...", flush=True)
        bench.prepare_ttft()
        ttft = bench.measure_ttft()
        decode = bench.measure_decode()
        recompiled = bench.engine_recompiled
    finally:
        bench.close()
        shutil.rmtree(cache_dir, ignore_errors=True)
        if model_tmp:
            shutil.rmtree(model_tmp, ignore_errors=True)
    print(f"\n(total {time.perf_counter() - start:.0f} s)\n")
    print("\n\n".join([
        f"Time to first token: wall time of LLM.generate of ONE request (prompt of "
        f"{args.prompt_len} random ids, max_tokens=1), plus pool.compile_all where named; "
        f"median of {args.ttft_rounds} rounds, ± half the range. Cold: a JSON Schema never "
        "seen before (a fresh enum value each round); precompiled/repeat: the same schema "
        "every round.",
        report_ttft(ttft, args.ttft_rounds),
        f"Decode: B requests, prompts of {args.prompt_len} random ids, {args.decode_tokens} "
        "decode steps each (max_tokens="
        f"{args.decode_tokens + 1}, all end by length); ms/step = (last - first token time)"
        f" / {args.decode_tokens} from the engine's per-request timestamps (median over the"
        f" B requests, then over {args.decode_rounds} rounds, ± half the range); tok/s = "
        "B / ms/step. Constrained: a JSON Schema array of >= "
        f"{args.decode_tokens} small objects, a fresh schema every run (plugin: compiled "
        "by the pool first; built-in: compiled by the engine). Unconstrained: "
        "ignore_eos=True.",
        report_decode(decode, args.batch_sizes),
        "Constrained decoding is the same code path for both: the plugin changes only where "
        "the grammar comes from (deserialized from disk instead of compiled); every step "
        "then runs vLLM's own xgrammar matcher (bitmask fill, logits masking, accept). "
        f"Plugin-path grammars the engine compiled again instead of loading: {recompiled}.",
    ]))


if __name__ == "__main__":
    main()
