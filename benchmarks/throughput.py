"""Prefill and decode throughput of the tiny V4.1 served by the plugin, side by side with
vLLM's built-in Llama of about the same size and with the plain-PyTorch reference forward,
and decode after long prompts for the two engines.

    python benchmarks/throughput.py --model checkpoints/tiny-v41-flash [--quick] [--json PATH]
        [--dtype {float32,bfloat16}]

All systems are measured in one process, round by round (the order rotates every round),
and every figure is the median over the rounds, so a noisy machine affects them alike.
Each model's parameters, KV-cache bytes and FLOPs per token (model_costs.py) are printed
beside. See docs/benchmarks.md for what each number means.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from model_costs import (
    FlopCount,
    KVBytes,
    ParamCount,
    llama_flops,
    llama_kv_bytes,
    llama_param_count,
    llama_shapes,
    v41_args,
    v41_flops,
    v41_kv_bytes,
    v41_param_count,
)
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fixtures/, tools/

PROMPT_IDS = (3, 800)  # token ids of the random prompts: [low, high)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
LLAMA_HEAD_DIM = 64  # vLLM's CPU attention rejects head_dim 16; 32, 64 and 128 work
SETTLE_S = 1.5  # a vLLM worker busy-polls for 1 s after its last step; let it go idle
MIN_MODEL_LEN = 256  # room for vLLM's chat-template warm-up, which logs a traceback otherwise
PLUGIN_BLOCK_SIZE = 16
LLAMA_BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32 only
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}  # --dtype choices, as the plot title says them
KV_SPACE_MARGIN = 1.1  # over the KV bytes an engine's requests hold at most: block rounding
ENGINE_MEMORY_GIB = 2  # what a starting engine's processes take besides the KV space, about
SYSTEM_LABELS = {
    "plugin": "V4.1 plugin",
    "llama": "vLLM Llama",
    "reference": "reference",
    "plugin_bi": "V4.1 batch-inv.",
    "plugin_eager": "V4.1 eager",
}
BATCH_INVARIANT = "plugin_bi"  # the plugin's engine again, with DEEPINFER_BATCH_INVARIANT=1
EAGER = "plugin_eager"  # the plugin's engine again, with enforce_eager=True
# Both engines schedule synchronously: vLLM's CPU platform turns async scheduling off for
# its Llama, and the plugin turns it on for V4.1 unless told otherwise.
SAME_SCHEDULING = {"DEEPINFER_ASYNC_SCHEDULING": "off"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        required=True,
        help="tiny V4.1 checkpoint dir (written there if config.json is missing)",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--prefill-len",
        type=int,
        default=128,
        help="prompt length of the prefill runs (max_tokens=1)",
    )
    parser.add_argument(
        "--decode-prompt-len", type=int, default=16, help="prompt length of the decode runs"
    )
    parser.add_argument(
        "--decode-tokens",
        type=int,
        default=32,
        help="decoded tokens per request, after the first (prefill) token",
    )
    parser.add_argument(
        "--context-lens",
        type=int,
        nargs="*",
        default=[1024, 4096, 16384],
        help="prompt lengths of the long-context decode rows (none: no rows)",
    )
    parser.add_argument(
        "--context-batch",
        type=int,
        default=8,
        help="requests decoding together in the long-context rows",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="measurements per system and row; the median is reported",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, len(os.sched_getaffinity(0)) - 1),
        help="compute threads of each vLLM worker and of the reference "
        "(default: all CPUs but one, which vLLM's engine process keeps)",
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="weights, activations and KV caches of every system",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: batches 1 2, short prompts, 4 decode tokens, contexts 256 512, 1 round",
    )
    args = parser.parse_args()
    if args.quick:
        args.batch_sizes, args.prefill_len, args.decode_prompt_len = [1, 2], 32, 8
        args.decode_tokens, args.context_lens, args.rounds = 4, [256, 512], 1
    return args


def configure_vllm_env() -> None:
    """Log volume; before vllm is imported. The KV space is set per engine (VllmSystem)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def pin_compute_threads(threads: int) -> str:
    """The same number of compute threads for the vLLM workers (bound to the first CPUs)
    and for the reference, which runs in this process; returns the workers' CPU ids."""
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    torch.set_num_threads(threads)
    return cpus


# ---------------------------------------------------------------------------- checkpoints


def ensure_v41_checkpoint(path: str) -> dict:
    """The text config of the V4.1 checkpoint at `path`, writing the tiny one if absent."""
    from fixtures.tiny import ensure_checkpoint

    with open(os.path.join(ensure_checkpoint(path), "config.json")) as f:
        return json.load(f)["text_config"]


def llama_config_like(v41: dict, target: ParamCount) -> dict:
    """V4.1's vocabulary, width and depth, heads of LLAMA_HEAD_DIM spanning the width; the
    MLP width (a multiple of 64) is the one whose dense count lies closest to the MoE's
    total and active counts alike."""
    heads = v41["hidden_size"] // LLAMA_HEAD_DIM
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": v41["vocab_size"],
        "hidden_size": v41["hidden_size"],
        "num_hidden_layers": v41["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": LLAMA_HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": v41["max_position_embeddings"],
        "rms_norm_eps": v41["rms_norm_eps"],
        "rope_theta": v41["rope_theta"],
        "tie_word_embeddings": False,
        "bos_token_id": v41["bos_token_id"],
        "eos_token_id": v41["eos_token_id"],
        "torch_dtype": "bfloat16",
    }

    def mismatch(intermediate: int) -> float:
        count = llama_param_count({**config, "intermediate_size": intermediate})
        return max(abs(count.total / target.total - 1), abs(count.total / target.active - 1))

    config["intermediate_size"] = min(range(64, 64 * 128, 64), key=mismatch)
    return config


def write_llama_checkpoint(out_dir: str, config: dict, tokenizer_dir: str) -> None:
    """Random bf16 weights (std 0.02, unit norms) and the V4.1 checkpoint's tokenizer."""
    gen = torch.Generator().manual_seed(0)
    tensors = {
        name: (
            torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02
        ).to(torch.bfloat16)
        for name, shape in llama_shapes(config).items()
    }
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(tokenizer_dir, name), out_dir)


# ------------------------------------------------------------------------------- systems


def random_prompts(rng: random.Random, batch: int, length: int) -> list[list[int]]:
    return [[rng.randrange(*PROMPT_IDS) for _ in range(length)] for _ in range(batch)]


@dataclass(frozen=True)
class EngineLimits:
    """What an engine is sized for: every row it runs fits at once. The first three are
    the engine's arguments, the same for every engine of the run, so that the variants
    differ from the plugin's engine in their variant alone; the last two size the KV space,
    which only the engines that run the long-context rows need large."""

    max_batch: int
    max_model_len: int
    max_batch_tokens: int
    peak_tokens: int  # the most tokens the requests of one generate call hold together
    cached_prefix_tokens: int  # the long prompts of one context row, kept in the prefix cache

    @classmethod
    def for_run(cls, args: argparse.Namespace, context_rows: bool = True) -> EngineLimits:
        short_len = max(
            args.prefill_len + 1, args.decode_prompt_len + args.decode_tokens + 1, MIN_MODEL_LEN
        )
        context_len = max(args.context_lens, default=0) + args.decode_tokens + 1
        max_batch = max(args.batch_sizes)
        peak_tokens = max_batch * short_len
        if context_rows:
            peak_tokens = max(peak_tokens, args.context_batch * context_len)
        return cls(
            max_batch=max(max_batch, args.context_batch),
            max_model_len=max(short_len, context_len),
            # short prompts prefill in one step; long ones in chunks of this size
            max_batch_tokens=max(max_batch * args.prefill_len, short_len),
            peak_tokens=peak_tokens,
            cached_prefix_tokens=(
                args.context_batch * max(args.context_lens, default=0) if context_rows else 0
            ),
        )


def kv_space_gib(tokens: int, kv_bytes_per_token: int) -> int:
    """Whole GiB of KV space for `tokens` tokens of a model (model_costs.py's bytes)."""
    return math.ceil(tokens * kv_bytes_per_token * KV_SPACE_MARGIN / 2**30)


def check_memory(name: str, kv_space_gib: int) -> None:
    """Raise here, before a minute of start-up, if the machine lacks the memory for an
    engine's KV space: vLLM's worker would refuse it only once the model is built and
    warmed up. Same memory figure as the worker's check, with room for the engine's own
    processes, which do not run yet."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    node = get_allowed_cpu_list()[0].numa_node
    available = get_memory_node_info(node).available_memory / 2**30
    if available < kv_space_gib + ENGINE_MEMORY_GIB:
        raise RuntimeError(
            f"{name}: {kv_space_gib} GiB of KV space (VLLM_CPU_KVCACHE_SPACE) and about "
            f"{ENGINE_MEMORY_GIB} GiB for the engine's processes do not fit the "
            f"{available:.2f} GiB available on memory node {node}"
        )


class VllmSystem:
    """One vLLM engine with prefix caching on: the short rows use fresh prompts for every
    run, and the long-context rows reuse a prompt only within one measurement.

    Every engine first starts with `first_kv_gib`, the KV space of the short rows, so
    that a compiled start and an eager start of the same model allocate the same pool and
    their difference is the compile time (zeroing the pool takes seconds per GiB). An
    engine whose `limits` need more (the long-context rows) restarts with it, loading
    vLLM's compile cache, only when those rows begin (`grow_for_context`): during the
    short rows four engines are alive, and the long rows' pools beside them did not fit
    a 24 GiB machine."""

    batched = True

    def __init__(
        self,
        name: str,
        model: str,
        block_size: int,
        limits: EngineLimits,
        kv_bytes_per_token: int,
        rng: random.Random,
        dtype: torch.dtype,
        first_kv_gib: int,
        environment: dict[str, str] | None = None,
        context_rows: bool = True,
        enforce_eager: bool = False,
    ):
        self.name, self.model, self.block_size, self.rng = name, model, block_size, rng
        self.limits, self.dtype = limits, dtype
        self.environment = environment or {}  # set while the engine starts its processes
        self.context_rows = context_rows
        self.enforce_eager = enforce_eager
        self.llm = None
        start = time.perf_counter()
        self._start(first_kv_gib)
        self.first_start_s = time.perf_counter() - start
        try:
            for_peak = kv_space_gib(limits.peak_tokens, kv_bytes_per_token)
            # Capacity and blocks grow in proportion to the space: the first start says
            # how many per GiB.
            capacity = self.kv_capacity_tokens * for_peak // self.kv_space_gib
            if capacity < limits.peak_tokens:
                raise RuntimeError(
                    f"{name}: {for_peak} GiB of KV cache hold {capacity} tokens, the run "
                    f"needs {limits.peak_tokens} at once; the KV bytes per token "
                    f"({kv_bytes_per_token}) of model_costs.py no longer match the engine"
                )
            needed = self._blocks_to_keep_cached()
            self.context_kv_gib = max(
                for_peak, math.ceil(self.kv_space_gib * needed / self.num_blocks)
            )
        except BaseException:
            self.close()  # the caller gets no object to close
            raise

    def grow_for_context(self) -> None:
        """Restart with the KV space the long-context rows need, if the first was less."""
        if self.context_kv_gib > self.kv_space_gib:
            self.close()
            self._start(self.context_kv_gib)

    def _start(self, kv_space_gib: int) -> None:
        from vllm import LLM

        check_memory(self.name, kv_space_gib)
        self.kv_space_gib = kv_space_gib
        # vLLM's CPU platform reads it when LLM() builds the engine's config.
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
        from vllm_deepinfer import envs

        limits = self.limits
        with envs.overridden(**self.environment):
            self.llm = LLM(
                model=self.model,
                dtype=self.dtype,
                enforce_eager=self.enforce_eager,
                block_size=self.block_size,
                max_model_len=limits.max_model_len,
                max_num_seqs=limits.max_batch,
                max_num_batched_tokens=limits.max_batch_tokens,
                enable_chunked_prefill=True,
                enable_prefix_caching=True,
                seed=0,
            )
        cache_config = self.llm.llm_engine.vllm_config.cache_config
        self.kv_capacity_tokens = cache_config.kv_cache_size_tokens
        self.num_blocks = cache_config.num_gpu_blocks

    def _blocks_to_keep_cached(self) -> int:
        """Blocks the long-context rows need to find their prompts cached. While a prompt
        is prefilled, every cache group takes a block per block_size tokens; sliding-window
        groups give theirs back early, but given-back blocks are evicted oldest first, so
        the first prompt of a batch stays cached only if the blocks every prompt of the
        batch took all fit in the pool (else each run evicts what the next one needs)."""
        groups = len(self.llm.llm_engine.engine_core.call_utility("get_kv_cache_group_metadata"))
        return math.ceil(
            groups * self.limits.cached_prefix_tokens / self.block_size * KV_SPACE_MARGIN
        )

    def _prompts(self, batch: int, length: int) -> list:
        from vllm.inputs import TokensPrompt

        return [
            TokensPrompt(prompt_token_ids=ids) for ids in random_prompts(self.rng, batch, length)
        ]

    def _generate_s(self, prompts: list, max_tokens: int, min_cached: int = 0) -> float:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
        cached = min(o.num_cached_tokens or 0 for o in outputs)
        if cached < min_cached:
            raise RuntimeError(
                f"{self.name}: a prefilled prompt found {cached} tokens in the "
                f"prefix cache, expected at least {min_cached}"
            )
        return elapsed

    def _decode_s(
        self, first_prompts: list, decode_prompts: list, new_tokens: int, min_cached: int = 0
    ) -> float:
        """The extra time of max_tokens=1+new_tokens over max_tokens=1 pays the decode."""
        first_only = self._generate_s(first_prompts, 1, min_cached)
        return self._generate_s(decode_prompts, 1 + new_tokens, min_cached) - first_only

    def prefill_rate(self, batch: int, prompt_len: int) -> float:
        return batch * prompt_len / self._generate_s(self._prompts(batch, prompt_len), 1)

    def decode_rate(self, batch: int, prompt_len: int, new_tokens: int) -> float:
        seconds = self._decode_s(
            self._prompts(batch, prompt_len), self._prompts(batch, prompt_len), new_tokens
        )
        return batch * new_tokens / seconds

    def context_decode_rate(self, batch: int, prompt_len: int, new_tokens: int) -> float:
        """Decode after long prompts, prefilled once untimed: both timed runs find them in
        the prefix cache (all but the last block), so they differ by the decode steps alone
        and no run pays a long prefill twice. The prompts are fresh for every measurement."""
        prompts = self._prompts(batch, prompt_len)
        self._generate_s(prompts, 1)
        seconds = self._decode_s(prompts, prompts, new_tokens, prompt_len - self.block_size)
        return batch * new_tokens / seconds

    def close(self) -> None:
        """Shut the engine's processes down; again, or after a failed start, does nothing."""
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


class ReferenceSystem:
    """ReferenceV41's greedy loop: each token recomputes the whole sequence, in the run's
    dtype.

    It has no batching: a batch of B is B sequences one after another, so its tokens/s
    do not depend on B. One request is measured per round and stands for every batch size.
    """

    batched = False

    def __init__(self, model: str, rng: random.Random, dtype: torch.dtype):
        from fixtures.reference import ReferenceV41

        self.name, self.rng = "reference", rng
        self.ref = ReferenceV41(model, dtype)

    def _step_seconds(self, prompt_len: int, max_tokens: int) -> list[float]:
        """Wall time of each greedy step; step 0 reads only the prompt."""
        ids, steps = random_prompts(self.rng, 1, prompt_len)[0], []
        for _ in range(max_tokens):
            start = time.perf_counter()
            ids.append(int(self.ref.logits(ids)[-1].argmax()))
            steps.append(time.perf_counter() - start)
        return steps

    def prefill_rate(self, batch: int, prompt_len: int) -> float:
        return prompt_len / self._step_seconds(prompt_len, 1)[0]

    def decode_rate(self, batch: int, prompt_len: int, new_tokens: int) -> float:
        return new_tokens / sum(self._step_seconds(prompt_len, 1 + new_tokens)[1:])


# ----------------------------------------------------------------------------- measuring

# (system, "prefill" | "decode" | "context", batch size or context length) -> tok/s per round
Results = dict[tuple[str, str, int], list[float]]


def measure_system(system, args: argparse.Namespace, results: Results) -> None:
    """One prefill and one decode measurement per batch size (for an unbatched system one
    request, which stands for every batch size)."""
    if system.batched:
        runs = [(batch, [batch]) for batch in args.batch_sizes]
    else:
        runs = [(1, args.batch_sizes)]
    for batch, reported_for in runs:
        prefill = system.prefill_rate(batch, args.prefill_len)
        decode = system.decode_rate(batch, args.decode_prompt_len, args.decode_tokens)
        for b in reported_for:
            results.setdefault((system.name, "prefill", b), []).append(prefill)
            results.setdefault((system.name, "decode", b), []).append(decode)
    time.sleep(SETTLE_S)


def measure_context(system: VllmSystem, args: argparse.Namespace, results: Results) -> None:
    """One decode measurement per context length (the reference, which recomputes the
    whole sequence for every token, is not run after long prompts)."""
    for context in args.context_lens:
        rate = system.context_decode_rate(args.context_batch, context, args.decode_tokens)
        results.setdefault((system.name, "context", context), []).append(rate)
    time.sleep(SETTLE_S)


def warm_up(systems, args: argparse.Namespace) -> None:
    """Unrecorded runs at the largest batch, so that first-call allocations and kernel
    choices are not timed."""
    for system in systems:
        batch = max(args.batch_sizes) if system.batched else 1
        system.prefill_rate(batch, args.prefill_len)
        system.decode_rate(batch, args.decode_prompt_len, 2)
    time.sleep(SETTLE_S)


def in_rounds(systems, args: argparse.Namespace, results: Results, measure_one) -> None:
    """Rounds of every system in turn; each round starts one system later than the last."""
    for round_ in range(args.rounds):
        shift = round_ % len(systems)
        for system in systems[shift:] + systems[:shift]:
            start = time.perf_counter()
            measure_one(system, args, results)
            print(
                f"  round {round_ + 1}/{args.rounds}: {system.name} took "
                f"{time.perf_counter() - start:.0f} s",
                flush=True,
            )


def measure(systems, args: argparse.Namespace) -> Results:
    """The short rows of every system in rounds; then the engines without long-context rows
    are shut down (four engines' memory and the long prompts' prefill did not fit a 24 GiB
    machine together), the others restart with the long rows' KV space, and the
    long-context rows run in rounds of their own, after an unrecorded run at the shortest
    context."""
    results: Results = {}
    warm_up(systems, args)
    in_rounds(systems, args, results, measure_system)
    long_context = [s for s in systems if isinstance(s, VllmSystem) and s.context_rows]
    if args.context_lens:
        close_all([s for s in systems if s not in long_context])
        for system in long_context:
            system.grow_for_context()
            system.context_decode_rate(args.context_batch, min(args.context_lens), 2)
        in_rounds(long_context, args, results, measure_context)
    return results


# ------------------------------------------------------------------------------ reporting


@dataclass(frozen=True)
class ModelCosts:
    """One model's per-token costs, as printed beside the figures."""

    params: ParamCount
    kv: KVBytes
    flops: FlopCount


def describe_costs(costs: dict[str, ModelCosts], llama_config: dict, dtype: str) -> str:
    v41, llama = costs["plugin"], costs["llama"]
    c = llama_config

    def params(name: str, count: ParamCount) -> str:
        return (
            f"  {name:<19}total {count.total / 1e6:6.2f}M, active/token "
            f"{count.active / 1e6:6.2f}M, of which in matmuls {count.matmul / 1e6:6.2f}M"
        )

    def flops(name: str, count: FlopCount) -> str:
        return f"  {name:<19}{count.matmul / 1e6:8.2f}M {count.head / 1e6:8.2f}M" + "".join(
            f" {n / 1e6:9.2f}M" for n in count.attention.values()
        )

    contexts = "".join(f" {'attn ' + str(ctx):>10}" for ctx in v41.flops.attention)
    return "\n".join(
        [
            "Parameters (V4.1: the backbone, without the DSpark draft stages; 'in matmuls' "
            "leaves out tables read by token id):",
            params("tiny V4.1 (plugin)", v41.params),
            params("Llama", llama.params),
            f"  Llama: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
            f"{c['num_attention_heads']} heads x {c['head_dim']}, intermediate "
            f"{c['intermediate_size']}, vocab {c['vocab_size']}; total vs V4.1 total "
            f"{llama.params.total / v41.params.total - 1:+.1%}, vs V4.1 active "
            f"{llama.params.active / v41.params.active - 1:+.1%}, in matmuls "
            f"{llama.params.matmul / v41.params.matmul - 1:+.1%}",
            f"KV-cache bytes per token ({dtype}): V4.1 {v41.kv.per_token} over all its caches, "
            f"of which {v41.kv.beyond_windows} in the compressed caches that keep the whole "
            f"context (the rest stays in sliding windows); Llama {llama.kv.per_token}.",
            "FLOPs per token (2 per multiply-add, elementwise work left out; attention at each "
            "context length benchmarked):",
            f"  {'':<19}{'matmul':>9} {'head':>9}{contexts}",
            flops("tiny V4.1 (plugin)", v41.flops),
            flops("Llama", llama.flops),
        ]
    )


def cell(rates: list[float]) -> str:
    """Median, and half the range relative to it."""
    median = statistics.median(rates)
    spread = (max(rates) - min(rates)) / 2 / median
    return f"{median:9.1f} ±{spread:4.0%}"


def table(
    results: Results, phase: str, row_label: str, keys: list[int], names: tuple[str, ...]
) -> str:
    with_reference = "reference" in names
    lines = [
        f"{row_label:>7} "
        + " ".join(f"{SYSTEM_LABELS[n]:>16}" for n in names)
        + f" {'plugin/Llama':>13}"
        + (f" {'plugin/ref':>11}" if with_reference else "")
    ]
    for key in keys:
        rates = {n: results[(n, phase, key)] for n in names}
        median = {n: statistics.median(r) for n, r in rates.items()}
        lines.append(
            f"{key:>7} "
            + " ".join(f"{cell(rates[n]):>16}" for n in names)
            + f" {median['plugin'] / median['llama']:>12.2f}x"
            + (f" {median['plugin'] / median['reference']:>10.1f}x" if with_reference else "")
        )
    return "\n".join(lines)


def report(results: Results, args: argparse.Namespace, kernels: dict[str, tuple[str, str]]) -> str:
    all_systems, engines = ("plugin", "llama", "reference"), ("plugin", "llama")
    parts = [
        f"Prefill tokens/s: B prompts of {args.prefill_len} tokens, max_tokens=1, "
        f"B*{args.prefill_len} / time.",
        table(results, "prefill", "batch", args.batch_sizes, all_systems),
        f"Decode tokens/s: B prompts of {args.decode_prompt_len} tokens, "
        f"B*{args.decode_tokens} / (time(max_tokens={args.decode_tokens + 1}) - "
        f"time(max_tokens=1)).",
        table(results, "decode", "batch", args.batch_sizes, all_systems),
    ]
    parts += [
        "Eager (enforce_eager=True; the plugin's engine again, in the same rounds): "
        "tokens/s and what compiling gains.",
        variant_table(results, args.batch_sizes, EAGER, "eager", "gain"),
        "Batch-invariant mode (DEEPINFER_BATCH_INVARIANT=1, which runs the model eager; the "
        "plugin's engine again, in the same rounds): tokens/s and its cost against the "
        "normal (compiled) mode.",
        variant_table(results, args.batch_sizes, BATCH_INVARIANT, "batch-invariant", "cost"),
    ]
    if args.context_lens:
        parts += [
            f"Decode tokens/s after long prompts: {args.context_batch} prompts of L tokens, "
            f"prefilled once untimed, then {args.context_batch}*{args.decode_tokens} / "
            f"(time(max_tokens={args.decode_tokens + 1}) - time(max_tokens=1)), both runs "
            "finding the prompts in the prefix cache.",
            table(results, "context", "L", args.context_lens, engines),
        ]
    parts.append(
        f"Median of {args.rounds} round(s), ± half the range. The reference has no batching: "
        "one request is timed per round and stands for every batch size (a batch of B takes "
        "B times as long); its decode is the time of its greedy steps after the first, each "
        "recomputing the whole sequence."
    )
    parts.append(
        "Kernel paths of V4.1 on this machine (vllm_deepinfer.kernels.paths.selected(), "
        "asked in this process as the plugin's workers ask it):\n"
        + "\n".join(f"  {part}: {path} ({why})" for part, (path, why) in kernels.items())
    )
    return "\n\n".join(parts)


def variant_table(
    results: Results, batch_sizes: list[int], variant: str, label: str, change: str
) -> str:
    """The plugin's default engine against one of its variants: `change` is how much
    faster the default is ("gain") or how much the variant loses ("cost")."""
    lines = [f"{'phase':>8} {'batch':>6} {'normal':>16} {label:>16} {change:>7}"]
    for phase in ("decode", "prefill"):
        for batch in batch_sizes:
            normal, other = (results[(n, phase, batch)] for n in ("plugin", variant))
            ratio = statistics.median(other) / statistics.median(normal)
            value = 1 / ratio - 1 if change == "gain" else 1 - ratio
            lines.append(
                f"{phase:>8} {batch:>6} {cell(normal):>16} {cell(other):>16} {value:>7.1%}"
            )
    return "\n".join(lines)


def figures(
    results: Results, compile_s: dict[str, float], dtype: str, kernels: dict[str, str]
) -> dict:
    """The --json document, with the issue's keys only: medians by row; the batch-invariant
    and the eager engines' under "batch_invariant" and "eager" (as "plugin", per phase and
    batch); each model's first-start compile time; the run's dtype and which kernel path
    (vLLM's or the plugin's) each part of V4.1 takes. The per-token costs are printed, not
    written."""
    variants = {BATCH_INVARIANT: "batch_invariant", EAGER: "eager"}
    out: dict = {
        "decode": {},
        "prefill": {},
        "context": {},
        **{key: {"decode": {}, "prefill": {}} for key in variants.values()},
        "compile_s": compile_s,
        "dtype": dtype,
        "kernels": kernels,
    }
    for (name, phase, key), rates in sorted(results.items(), key=lambda item: item[0][2]):
        rows, name = (
            (out[variants[name]][phase], "plugin") if name in variants else (out[phase], name)
        )
        rows.setdefault(str(key), {})[name] = statistics.median(rates)
    return out


# ----------------------------------------------------------------------------------- main


def start_systems(
    args: argparse.Namespace, llama_dir: str, costs: dict[str, ModelCosts], rng: random.Random
) -> tuple[list, dict[str, float]]:
    """Each engine gets the KV space its model needs for the rows it runs (VllmSystem):
    the plugin and Llama engines the long-context rows', the eager and batch-invariant
    engines the short rows' only. If a start fails, the engines already started are shut
    down before the error goes on (their processes would keep the run from exiting)."""
    from vllm_deepinfer import envs
    from vllm_deepinfer.determinism.batch_invariant import process_environment

    dtype = getattr(torch, args.dtype)
    limits = EngineLimits.for_run(args)
    short = EngineLimits.for_run(args, context_rows=False)
    started: list[VllmSystem] = []

    def start(
        name: str, model: str, block_size: int, costs_of: str, context_rows: bool = True, **kw
    ) -> VllmSystem:
        kv_bytes = costs[costs_of].kv.per_token
        system = VllmSystem(
            name,
            model,
            block_size,
            limits if context_rows else short,
            kv_bytes,
            rng,
            dtype,
            first_kv_gib=kv_space_gib(short.peak_tokens, kv_bytes),
            context_rows=context_rows,
            **kw,
        )
        started.append(system)
        return system

    with envs.overridden(DEEPINFER_BATCH_INVARIANT="1"):
        invariant = {
            "DEEPINFER_BATCH_INVARIANT": "1",
            **process_environment(on_cpu=True),
            **SAME_SCHEDULING,
        }
    try:
        plugin = start(
            "plugin", args.model, PLUGIN_BLOCK_SIZE, "plugin", environment=SAME_SCHEDULING
        )
        llama = start("llama", llama_dir, LLAMA_BLOCK_SIZE, "llama")
        # Compile time: the first (compiling) start against an eager start of the same
        # model, limits and first KV space; an eager Llama is started for this alone, next
        # to the compiled one and closed at once (a fifth engine alive would not fit a
        # 24 GiB machine beside the long-context rows' KV spaces).
        llama_eager = start(
            "llama", llama_dir, LLAMA_BLOCK_SIZE, "llama", context_rows=False, enforce_eager=True
        )
        llama_eager.close()
        eager = start(
            EAGER,
            args.model,
            PLUGIN_BLOCK_SIZE,
            "plugin",
            context_rows=False,
            environment=SAME_SCHEDULING,
            enforce_eager=True,
        )
        invariant_engine = start(
            BATCH_INVARIANT,
            args.model,
            PLUGIN_BLOCK_SIZE,
            "plugin",
            context_rows=False,
            environment=invariant,
        )
        systems = [plugin, llama, eager, invariant_engine]
        reference = ReferenceSystem(args.model, rng, dtype)
    except BaseException:
        close_all(started)
        raise
    compile_s = {
        "plugin": plugin.first_start_s - eager.first_start_s,
        "llama": llama.first_start_s - llama_eager.first_start_s,
    }
    print(
        f"First-start compile time (compiled start - eager start): plugin "
        f"{compile_s['plugin']:.1f} s, Llama {compile_s['llama']:.1f} s "
        f"({compile_s['plugin'] / compile_s['llama']:.2f}x).",
        flush=True,
    )
    print(
        f"Engines: max_model_len {limits.max_model_len}, max_num_batched_tokens "
        f"{limits.max_batch_tokens}, max_num_seqs {limits.max_batch}; the plugin and Llama "
        f"engines hold up to {limits.peak_tokens} tokens at once and the long-context rows "
        f"keep {limits.cached_prefix_tokens} prompt tokens cached, the others (no context "
        f"rows) up to {short.peak_tokens}; every engine first starts with the short rows' "
        "KV space (the plugin and Llama restart with the long rows' when those begin); "
        + ", ".join(
            f"{s.name}{' (eager, compile time)' if s is llama_eager else ''} "
            f"VLLM_CPU_KVCACHE_SPACE={s.kv_space_gib} GiB "
            f"({s.num_blocks} blocks, {s.kv_capacity_tokens} tokens)"
            + (f", then {s.context_kv_gib} GiB" if s.context_rows else "")
            for s in started
        )
        + ".",
        flush=True,
    )
    return systems + [reference], compile_s


def close_all(systems) -> None:
    """Shut every vLLM engine down, each even if closing another fails."""
    for system in systems:
        if isinstance(system, VllmSystem):
            try:
                system.close()
            except Exception as error:
                print(f"closing {system.name}: {error!r}", file=sys.stderr, flush=True)


def main() -> None:
    args = parse_args()
    from vllm_deepinfer.preload import reexec_with_preloads

    reexec_with_preloads()  # tcmalloc and Intel's OpenMP, as vLLM's CPU guide asks
    configure_vllm_env()
    cpus = pin_compute_threads(args.threads)
    itemsize = getattr(torch, args.dtype).itemsize
    v41_config = ensure_v41_checkpoint(args.model)
    v41 = v41_args(v41_config)
    v41_count = v41_param_count(v41)
    llama_config = llama_config_like(v41_config, v41_count)
    costs = {
        "plugin": ModelCosts(
            v41_count, v41_kv_bytes(v41, itemsize), v41_flops(v41, args.context_lens)
        ),
        "llama": ModelCosts(
            llama_param_count(llama_config),
            llama_kv_bytes(llama_config, itemsize),
            llama_flops(llama_config, args.context_lens),
        ),
    }
    print(describe_costs(costs, llama_config, args.dtype))
    print(
        f"Compute threads: {args.threads} (vLLM workers on CPU {cpus}, reference "
        f"torch.set_num_threads({args.threads})); {args.dtype} everywhere; KV block size "
        f"{PLUGIN_BLOCK_SIZE} (plugin), {LLAMA_BLOCK_SIZE} (Llama).",
        flush=True,
    )
    with (
        tempfile.TemporaryDirectory(prefix="llama-like-v41-") as llama_dir,
        tempfile.TemporaryDirectory(prefix="vllm-compile-cache-") as compile_cache,
    ):
        # Both models compile at their first start here (an empty vLLM compile cache).
        os.environ["VLLM_CACHE_ROOT"] = compile_cache
        write_llama_checkpoint(llama_dir, llama_config, args.model)
        systems, compile_s = start_systems(args, llama_dir, costs, random.Random(0))
        try:
            from vllm_deepinfer.kernels import paths

            # This process asks what the plugin's workers ask, with vLLM's kernels loaded.
            model = paths.Model(
                getattr(torch, args.dtype), v41.n_routed_experts, v41.num_experts_per_tok
            )
            kernels = paths.selected(model)
            print("Warming up, then measuring ...", flush=True)
            results = measure(systems, args)
        finally:
            close_all(systems)
    print()
    print(report(results, args, kernels))
    if args.json:
        out = figures(results, compile_s, args.dtype, paths.summary(model))
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"\nWrote {args.json}")
        from plots import write_plot  # the PNG beside the JSON

        write_plot(
            args.json,
            f"V4.1 plugin vs vLLM's Llama vs the reference ({DTYPES[args.dtype]}, CPU)",
            {
                f"{phase} tokens/s": {f"batch {b}": row for b, row in out[phase].items()}
                for phase in ("decode", "prefill")
            },
        )


if __name__ == "__main__":
    main()
