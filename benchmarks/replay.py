"""Bounded replay, decoder-side (YOCO) replay and the global-only prefix cache, measured.

Side by side in one run, on the plugin's V4.1 in fp32 on the CPU:
- hit prefill: a 64-token suffix after a cached prefix of 1k and 16k tokens (replay on),
  and the same 16k prompt without the cache (a fresh prefix);
- tokens replayed per hit, read from the engine's replay tracker;
- a 4k-token prefill with decoder-side replay on (the default keep) and off (exact mode),
  with the model's forward time per layer, so the share of prefill work at and after the
  last kv source and how much of it decoder-side replay saves are measured, not assumed;
- prefix-cache capacity in one KV space: distinct prompts are prefilled until the cache
  is full, then probed newest first; exact mode, replay, replay with the release's global
  KV precisions;
- persisted (global) KV bytes per token at the release precisions, tiny and Flash.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fixtures/, tools/

SUFFIX = 64
KEEP = 140
CONTEXTS = (1024, 16384)
YOCO_PROMPT = 4096
CAPACITY_PROMPT = 256
CAPACITY_KV_BYTES = 64 << 20
KV_SPACE_BYTES = 4 << 30
FLASH_GLOBAL_KV = SimpleNamespace(
    kv_source_layer_ids=(2, 8, 14, 20),
    head_dim=512,
    index_head_dim=128,
    ratio=lambda layer: 1 if layer == 20 else 2,
)
"""The Flash facts the persisted-bytes formula reads (docs: v41-flash-architecture.md)."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="checkpoints/tiny-v41-flash",
        help="a V4.1 checkpoint directory (the tiny one is written if absent)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed repeats (median)")
    parser.add_argument("--json", metavar="PATH", help="also write the issue's keys to PATH")
    return parser.parse_args()


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 800) for _ in range(length)]


class Engine:
    """One in-process vLLM engine (in-process so the layer timers reach the model)."""

    def __init__(self, model: str, keep: int, **options):
        from vllm import LLM

        os.environ["DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"] = str(keep)
        settings = dict(
            model=model,
            dtype="float32",
            block_size=16,
            seed=0,
            kv_cache_memory_bytes=KV_SPACE_BYTES,
            max_model_len=max(CONTEXTS) + SUFFIX + 16,
            max_num_batched_tokens=4096,
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
        )
        settings.update(options)
        self.llm = LLM(**settings)

    def prefill_s(self, prompt_ids: list[int], min_cached: int = 0) -> float:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        start = time.perf_counter()
        (output,) = self.llm.generate(
            [TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False
        )
        elapsed = time.perf_counter() - start
        self.cached = output.num_cached_tokens or 0
        if self.cached < min_cached:
            raise RuntimeError(f"found {self.cached} tokens cached, expected {min_cached}")
        return elapsed

    def replayed_rows(self) -> int:
        return self.llm.collective_rpc("deepinfer_replay_stats")[0]["replayed_rows"]

    def layer_timer(self, on: bool) -> dict[int, float] | None:
        """Starts (on) or stops and returns forward seconds per decoder layer, and the whole
        forward under key -1."""
        return self.llm.collective_rpc(_layer_timer, args=(on,))[0]

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm


def _layer_timer(worker, on: bool):
    """Forward hooks on the model (-1) and each decoder layer, in the worker."""
    model = worker.model_runner.model
    if on:
        model._deepinfer_times = times = {}
        modules = [(-1, model)] + list(enumerate(model.model.layers))

        def hooks(key, module):
            def start(*_):
                module._deepinfer_start = time.perf_counter()

            def stop(*_):
                times[key] = times.get(key, 0.0) + time.perf_counter() - module._deepinfer_start

            return [module.register_forward_pre_hook(start), module.register_forward_hook(stop)]

        model._deepinfer_hooks = [h for key, module in modules for h in hooks(key, module)]
        return None
    for handle in model._deepinfer_hooks:
        handle.remove()
    return model._deepinfer_times


def measure_hits(engine: Engine, rng: random.Random, rounds: int, results: dict) -> None:
    """A cached prefix, then `rounds` prompts of it plus a fresh 64-token suffix."""
    for context in CONTEXTS:
        prefix = prompt(rng, context)
        engine.prefill_s(prefix + prompt(rng, SUFFIX))
        times, replayed = [], []
        for _ in range(rounds):
            before = engine.replayed_rows()
            times.append(engine.prefill_s(prefix + prompt(rng, SUFFIX), min_cached=context))
            replayed.append(engine.replayed_rows() - before)
        results["hit_prefill_s"][str(context)] = statistics.median(times)
        results["replayed_tokens"][str(context)] = statistics.median(replayed)
    context = max(CONTEXTS)
    results["no_cache_prefill_s"][str(context)] = statistics.median(
        engine.prefill_s(prompt(rng, context + SUFFIX)) for _ in range(max(1, rounds - 1))
    )


def measure_prefill_layers(engine: Engine, rng: random.Random, rounds: int):
    """Wall seconds of a fresh 4k prefill, and the model's forward seconds per layer."""
    engine.prefill_s(prompt(rng, YOCO_PROMPT))  # warm-up
    walls, layers = [], []
    for _ in range(rounds):
        engine.layer_timer(True)
        walls.append(engine.prefill_s(prompt(rng, YOCO_PROMPT)))
        layers.append(engine.layer_timer(False))
    middle = sorted(range(rounds), key=walls.__getitem__)[rounds // 2]
    return walls[middle], layers[middle]


def measure_capacity(model: str, keep: int, rng: random.Random, **options) -> int:
    """Prefix tokens one KV space keeps: distinct prompts prefilled until the cache is
    full (three times what exact mode could hold), then probed newest first until one
    misses; each probe's hit counts."""
    engine = Engine(
        model,
        keep,
        kv_cache_memory_bytes=CAPACITY_KV_BYTES,
        max_model_len=2 * CAPACITY_PROMPT,
        max_num_batched_tokens=1024,
        **options,
    )
    try:
        config = engine.llm.llm_engine.vllm_config.cache_config
        kv_config = engine.llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        cached_groups = sum(g.kv_cache_spec.prefix_cacheable for g in kv_config.kv_cache_groups)
        most = config.num_gpu_blocks * config.block_size // CAPACITY_PROMPT + 2
        prompts = [prompt(rng, CAPACITY_PROMPT) for _ in range(most)]
        for ids in prompts:
            engine.prefill_s(ids)
        kept = 0
        for ids in reversed(prompts):
            engine.prefill_s(ids)
            if engine.cached < CAPACITY_PROMPT - 16:
                break
            kept += engine.cached
        print(
            f"  keep={keep} {options or ''}: {config.num_gpu_blocks} blocks, "
            f"{cached_groups} of {len(kv_config.kv_cache_groups)} KV cache groups "
            f"prefix-cached -> {kept} prefix tokens kept",
            flush=True,
        )
        return kept
    finally:
        engine.close()


def persisted_bytes(args) -> dict:
    from vllm_deepinfer.kv_cache.precision import (
        FP8_INDEX_KEY,
        MXFP4_INDEX_KEY,
        NVFP4_LATENT,
        V4_FP8_LATENT,
        persisted_bytes_per_token,
    )

    release = {
        "tiny": persisted_bytes_per_token(args, NVFP4_LATENT, MXFP4_INDEX_KEY, 2),
        "flash": persisted_bytes_per_token(FLASH_GLOBAL_KV, NVFP4_LATENT, MXFP4_INDEX_KEY, 2),
    }
    print(
        "Persisted (global) KV bytes per token: release precisions (NVFP4 latents, MXFP4 "
        f"index keys) tiny {release['tiny']:.0f}, Flash {release['flash']:.0f}; Flash with "
        "V4's records (584 B latents, FP8 keys) "
        f"{persisted_bytes_per_token(FLASH_GLOBAL_KV, V4_FP8_LATENT, FP8_INDEX_KEY, 2):.0f}"
        f"; tiny fp32 {persisted_bytes_per_token(args, None, None, 4):.0f}",
        flush=True,
    )
    return release


def main() -> None:
    args = parse_args()
    from vllm_deepinfer.preload import reexec_with_preloads

    reexec_with_preloads()  # tcmalloc and Intel's OpenMP, as vLLM's CPU guide asks
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Each engine's KV space is set here; vLLM's CPU platform would let this override it.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from fixtures.reference import read_checkpoint
    from fixtures.tiny import write_checkpoint

    if not os.path.exists(os.path.join(args.model, "config.json")):
        write_checkpoint(args.model)
    model_args, _ = read_checkpoint(args.model)
    rng = random.Random(0)
    results = {
        "hit_prefill_s": {},
        "no_cache_prefill_s": {},
        "replayed_tokens": {},
        "yoco_prefill_s": {},
        "persisted_bytes_per_token": persisted_bytes(model_args),
    }

    cut = model_args.decoder_replay_cut
    layer_share = {}
    for mode, keep in (("on", KEEP), ("off", 0)):
        engine = Engine(args.model, keep)
        try:
            if keep:
                measure_hits(engine, rng, args.rounds, results)
            wall, layers = measure_prefill_layers(engine, rng, args.rounds)
            results["yoco_prefill_s"][mode] = wall
            before_cut = sum(t for i, t in layers.items() if 0 <= i < cut)
            # The cut layer's KV pre-pass on every row runs outside the layers: it counts
            # as work at and after the cut.
            layer_share[mode] = (layers[-1], layers[-1] - before_cut)
        finally:
            engine.close()

    capacity = {
        name: measure_capacity(args.model, keep, rng, **options)
        for name, keep, options in (
            ("exact mode", 0, {}),
            ("replay", KEEP, {}),
            (
                "replay + release precisions",
                KEEP,
                {
                    "kv_cache_dtype": "nvfp4_ds_mla",
                    "attention_config": {"indexer_kv_dtype": "mxfp4"},
                },
            ),
        )
    }

    (off_forward, off_after_cut), (on_forward, on_after_cut) = (
        layer_share["off"],
        layer_share["on"],
    )
    saved = 1 - on_after_cut / off_after_cut
    hits = results["hit_prefill_s"]
    no_cache = results["no_cache_prefill_s"][str(max(CONTEXTS))]
    print(json.dumps(results, indent=2))
    print(
        f"hit prefill 16k/1k: {hits['16384'] / hits['1024']:.2f} (target <= 1.3); 16k hit / "
        f"no cache: {hits['16384'] / no_cache:.3f} (target <= 0.1)"
    )
    print(
        f"4k prefill forward: exact {off_forward:.2f} s, of which from layer {cut} on "
        f"{off_after_cut:.2f} s ({off_after_cut / off_forward:.0%}); decoder-side replay "
        f"{on_forward:.2f} s, of which from layer {cut} on {on_after_cut:.2f} s: saves "
        f"{saved:.0%} of the work at and after layer {cut} (target >= 80%)"
    )
    exact = capacity["exact mode"]
    print(
        "prefix tokens kept in one KV space: "
        + ", ".join(f"{name} {tokens} ({tokens / exact:.1f}x)" for name, tokens in capacity.items())
        + " (target >= 3x with the same dtype)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        from plots import write_plot  # the PNG beside the JSON

        write_plot(
            args.json,
            "Bounded and decoder-side replay: prefill seconds",
            {
                "prefix hit + 64 new tokens, s": {
                    f"{n}-token prefix": {
                        "hit (replayed)": hits[n],
                        "not cached": results["no_cache_prefill_s"].get(n),
                    }
                    for n in hits
                },
                "fresh 4096-token prompt, s": {"decoder-side replay": results["yoco_prefill_s"]},
            },
        )


if __name__ == "__main__":
    sys.exit(main())
