"""Prefill and decode throughput of the tiny V4.1 served by the plugin, side by side with
vLLM's built-in Llama of about the same size and with the plain-PyTorch reference forward.

    python benchmarks/throughput.py --model checkpoints/tiny-v41-flash [--quick]

All three systems are measured in one process, round by round (the order rotates every
round), and every figure is the median over the rounds, so a noisy machine affects them
alike. See benchmarks/README.md for what each number means.
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
import tempfile
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

PROMPT_IDS = (3, 800)  # token ids of the random prompts: [low, high)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
LLAMA_HEAD_DIM = 64  # vLLM's CPU attention rejects head_dim 16; 32, 64 and 128 work
SETTLE_S = 1.5  # a vLLM worker busy-polls for 1 s after its last step; let it go idle
MIN_MODEL_LEN = 256  # room for vLLM's chat-template warm-up, which logs a traceback otherwise
PLUGIN_BLOCK_SIZE = 16
LLAMA_BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32 only


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="tiny V4.1 checkpoint dir (written there if config.json is missing)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prefill-len", type=int, default=128,
                        help="prompt length of the prefill runs (max_tokens=1)")
    parser.add_argument("--decode-prompt-len", type=int, default=16,
                        help="prompt length of the decode runs")
    parser.add_argument("--decode-tokens", type=int, default=32,
                        help="decoded tokens per request, after the first (prefill) token")
    parser.add_argument("--rounds", type=int, default=3,
                        help="measurements per system and batch size; the median is reported")
    parser.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1),
                        help="compute threads of each vLLM worker and of the reference "
                             "(default: all CPUs but one, which vLLM's engine process keeps)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: batches 1 2, short prompts, 4 decode tokens, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.batch_sizes, args.prefill_len, args.decode_prompt_len = [1, 2], 32, 8
        args.decode_tokens, args.rounds = 4, 1
    return args


def configure_vllm_env() -> None:
    """Defaults for the engines' KV cache (GiB) and log volume; before vllm is imported."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
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
    from vllm_deepinfer.checkpoint.tiny import ensure_checkpoint

    with open(os.path.join(ensure_checkpoint(path), "config.json")) as f:
        return json.load(f)["text_config"]


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int  # touched per token: of the routed experts only top-k of n
    lookup: int  # tables read by token id (embeddings, Engram), in both counts above

    @property
    def matmul(self) -> int:
        """Active weights multiplied per token: the compute the two models should share."""
        return self.active - self.lookup


def v41_param_count(text_config: dict) -> ParamCount:
    """From the config's tensor layout (logical shapes, so quantized files count the same).
    Only the backbone: the DSpark draft stages (mtp.*) do not run without speculation."""
    from vllm_deepinfer.checkpoint.layout import backbone_layout
    from vllm_deepinfer.model.deepseek_v41.args import V41Args

    args = V41Args.from_hf_config(SimpleNamespace(**text_config))
    sizes = {name: math.prod(spec.shape) for name, spec in backbone_layout(args, False).items()}
    routed = sum(n for name, n in sizes.items() if ".ffn.experts." in name)
    idle_share = 1 - args.num_experts_per_tok / args.n_routed_experts
    total = sum(sizes.values())
    lookup = sum(n for name, n in sizes.items() if name.endswith("embed.weight"))
    return ParamCount(total, total - round(routed * idle_share), lookup)


def llama_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a HF LlamaForCausalLM checkpoint (untied embeddings)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h),
              "lm_head.weight": (config["vocab_size"], h),
              "model.norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter)})
    return shapes


def llama_param_count(config: dict) -> ParamCount:
    """A dense model: every parameter is active for every token."""
    shapes = llama_shapes(config)
    total = sum(math.prod(s) for s in shapes.values())
    return ParamCount(total, total, math.prod(shapes["model.embed_tokens.weight"]))


def llama_config_like(v41: dict, target: ParamCount) -> dict:
    """V4.1's vocabulary, width and depth, heads of LLAMA_HEAD_DIM spanning the width; the
    MLP width (a multiple of 64) is the one whose dense count lies closest to the MoE's
    total and active counts alike."""
    heads = v41["hidden_size"] // LLAMA_HEAD_DIM
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": v41["vocab_size"], "hidden_size": v41["hidden_size"],
        "num_hidden_layers": v41["num_hidden_layers"], "num_attention_heads": heads,
        "num_key_value_heads": heads, "head_dim": LLAMA_HEAD_DIM, "hidden_act": "silu",
        "max_position_embeddings": v41["max_position_embeddings"],
        "rms_norm_eps": v41["rms_norm_eps"], "rope_theta": v41["rope_theta"],
        "tie_word_embeddings": False, "bos_token_id": v41["bos_token_id"],
        "eos_token_id": v41["eos_token_id"], "torch_dtype": "bfloat16",
    }

    def mismatch(intermediate: int) -> float:
        count = llama_param_count({**config, "intermediate_size": intermediate})
        return max(abs(count.total / target.total - 1), abs(count.total / target.active - 1))

    config["intermediate_size"] = min(range(64, 64 * 128, 64), key=mismatch)
    return config


def write_llama_checkpoint(out_dir: str, config: dict, tokenizer_dir: str) -> None:
    """Random bf16 weights (std 0.02, unit norms) and the V4.1 checkpoint's tokenizer."""
    gen = torch.Generator().manual_seed(0)
    tensors = {name: (torch.ones(shape) if len(shape) == 1
                      else torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
               for name, shape in llama_shapes(config).items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(tokenizer_dir, name), out_dir)


# ------------------------------------------------------------------------------- systems

def random_prompts(rng: random.Random, batch: int, length: int) -> list[list[int]]:
    return [[rng.randrange(*PROMPT_IDS) for _ in range(length)] for _ in range(batch)]


class VllmSystem:
    """One vLLM engine; prefix caching is off, and every run gets fresh prompts anyway."""
    batched = True

    def __init__(self, name: str, model: str, block_size: int, max_batch: int,
                 max_model_len: int, max_batch_tokens: int, rng: random.Random):
        from vllm import LLM

        self.name, self.rng = name, rng
        self.llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=block_size,
                       max_model_len=max_model_len, max_num_seqs=max_batch,
                       max_num_batched_tokens=max_batch_tokens, enable_prefix_caching=False,
                       seed=0)

    def _generate_s(self, batch: int, prompt_len: int, max_tokens: int) -> float:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=ids)
                   for ids in random_prompts(self.rng, batch, prompt_len)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
        return elapsed

    def prefill_rate(self, batch: int, prompt_len: int) -> float:
        return batch * prompt_len / self._generate_s(batch, prompt_len, 1)

    def decode_rate(self, batch: int, prompt_len: int, new_tokens: int) -> float:
        """The extra time of max_tokens=1+new_tokens over max_tokens=1 pays the decode."""
        first_only = self._generate_s(batch, prompt_len, 1)
        with_decode = self._generate_s(batch, prompt_len, 1 + new_tokens)
        return batch * new_tokens / (with_decode - first_only)

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


class ReferenceSystem:
    """ReferenceV41's greedy loop: each token recomputes the whole sequence, in fp32.

    It has no batching: a batch of B is B sequences one after another, so its tokens/s
    do not depend on B. One request is measured per round and stands for every batch size.
    """
    batched = False

    def __init__(self, model: str, rng: random.Random):
        from vllm_deepinfer.model.reference import ReferenceV41

        self.name, self.rng = "reference", rng
        self.ref = ReferenceV41(model, torch.float32)

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

Results = dict[tuple[str, str, int], list[float]]  # (system, "prefill"|"decode", batch) -> tok/s


def measure_system(system, args: argparse.Namespace, results: Results) -> None:
    """One prefill and one decode measurement per batch size; for an unbatched system one
    request, which stands for every batch size."""
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


def warm_up(systems, args: argparse.Namespace) -> None:
    """Unrecorded runs, the vLLM engines' at the largest batch, so that first-call
    allocations and kernel choices are not timed."""
    for system in systems:
        batch = max(args.batch_sizes) if system.batched else 1
        system.prefill_rate(batch, args.prefill_len)
        system.decode_rate(batch, args.decode_prompt_len, 2)
    time.sleep(SETTLE_S)


def measure(systems, args: argparse.Namespace) -> Results:
    """Rounds of every system in turn; each round starts one system later than the last."""
    results: Results = {}
    for round_ in range(args.rounds):
        shift = round_ % len(systems)
        for system in systems[shift:] + systems[:shift]:
            start = time.perf_counter()
            measure_system(system, args, results)
            print(f"  round {round_ + 1}/{args.rounds}: {system.name} took "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    return results


# ------------------------------------------------------------------------------ reporting

def describe_counts(v41: ParamCount, llama: ParamCount, llama_config: dict) -> str:
    def line(name: str, count: ParamCount) -> str:
        return (f"  {name:<19}total {count.total / 1e6:6.2f}M, active/token "
                f"{count.active / 1e6:6.2f}M, of which in matmuls {count.matmul / 1e6:6.2f}M")

    c = llama_config
    return "\n".join([
        "Parameters (V4.1: the backbone, without the DSpark draft stages; 'in matmuls' "
        "leaves out tables read by token id):",
        line("tiny V4.1 (plugin)", v41),
        line("Llama", llama),
        f"  Llama: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
        f"{c['num_attention_heads']} heads x {c['head_dim']}, intermediate "
        f"{c['intermediate_size']}, vocab {c['vocab_size']}; total vs V4.1 total "
        f"{llama.total / v41.total - 1:+.1%}, vs V4.1 active {llama.active / v41.active - 1:+.1%}"
        f", in matmuls {llama.matmul / v41.matmul - 1:+.1%}",
    ])


def cell(rates: list[float]) -> str:
    """Median, and half the range relative to it."""
    median = statistics.median(rates)
    spread = (max(rates) - min(rates)) / 2 / median
    return f"{median:9.1f} ±{spread:4.0%}"


def table(results: Results, phase: str, batch_sizes: list[int]) -> str:
    names = ("plugin", "llama", "reference")
    lines = [f"{'batch':>5} {'V4.1 plugin':>16} {'vLLM Llama':>16} {'reference':>16}"
             f" {'plugin/Llama':>13} {'plugin/ref':>11}"]
    for b in batch_sizes:
        rates = {n: results[(n, phase, b)] for n in names}
        median = {n: statistics.median(r) for n, r in rates.items()}
        lines.append(f"{b:>5} " + " ".join(f"{cell(rates[n]):>16}" for n in names)
                     + f" {median['plugin'] / median['llama']:>12.2f}x"
                     + f" {median['plugin'] / median['reference']:>10.1f}x")
    return "\n".join(lines)


def report(results: Results, args: argparse.Namespace) -> str:
    return "\n\n".join([
        f"Prefill tokens/s: B prompts of {args.prefill_len} tokens, max_tokens=1, "
        f"B*{args.prefill_len} / time.",
        table(results, "prefill", args.batch_sizes),
        f"Decode tokens/s: B prompts of {args.decode_prompt_len} tokens, "
        f"B*{args.decode_tokens} / (time(max_tokens={args.decode_tokens + 1}) - "
        f"time(max_tokens=1)).",
        table(results, "decode", args.batch_sizes),
        f"Median of {args.rounds} round(s), ± half the range. The reference has no batching: "
        "one request is timed per round and stands for every batch size (a batch of B takes "
        "B times as long); its decode is the time of its greedy steps after the first, each "
        "recomputing the whole sequence.",
    ])


# ----------------------------------------------------------------------------------- main

def start_systems(args: argparse.Namespace, llama_dir: str, rng: random.Random) -> list:
    max_model_len = max(args.prefill_len + 1, args.decode_prompt_len + args.decode_tokens + 1,
                        MIN_MODEL_LEN)
    max_batch = max(args.batch_sizes)
    engine_limits = dict(max_batch=max_batch, max_model_len=max_model_len,
                         max_batch_tokens=max(max_batch * args.prefill_len, max_model_len),
                         rng=rng)
    return [VllmSystem("plugin", args.model, PLUGIN_BLOCK_SIZE, **engine_limits),
            VllmSystem("llama", llama_dir, LLAMA_BLOCK_SIZE, **engine_limits),
            ReferenceSystem(args.model, rng)]


def main() -> None:
    args = parse_args()
    configure_vllm_env()
    cpus = pin_compute_threads(args.threads)
    v41_config = ensure_v41_checkpoint(args.model)
    v41_count = v41_param_count(v41_config)
    llama_config = llama_config_like(v41_config, v41_count)
    print(describe_counts(v41_count, llama_param_count(llama_config), llama_config))
    print(f"Compute threads: {args.threads} (vLLM workers on CPU {cpus}, reference "
          f"torch.set_num_threads({args.threads})); fp32 everywhere; KV block size "
          f"{PLUGIN_BLOCK_SIZE} (plugin), {LLAMA_BLOCK_SIZE} (Llama).", flush=True)
    with tempfile.TemporaryDirectory(prefix="llama-like-v41-") as llama_dir:
        write_llama_checkpoint(llama_dir, llama_config, args.model)
        systems = start_systems(args, llama_dir, random.Random(0))
        try:
            print("Warming up ...", flush=True)
            warm_up(systems, args)
            results = measure(systems, args)
        finally:
            for system in systems:
                if isinstance(system, VllmSystem):
                    system.close()
    print()
    print(report(results, args))


if __name__ == "__main__":
    main()
