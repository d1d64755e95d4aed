"""DSpark speculative decoding on the trained tiny pair: no speculation, fixed-length
verification of 5 drafts, and DSpark's variable-length verification, side by side.

One run, each mode's engine in a fresh process of its own (engines built one after
another in one process run slower the later they come: no speculation measured last
lost 6-7% at 16 and 64 sequences here, which favoured whichever mode came first), the
same prompts (from the pair's corpus, its six span kinds in turn: some easy to draft,
some hard) and greedy decoding for every mode, at 1, 16 and 64 concurrent sequences
(at 1: 12 prompts one after another):
- tok_s: generated tokens per second of wall time (prefill included, alike in all modes);
- verified_per_step / accepted_per_step: draft tokens verified and accepted per request
  decode step, at 64 sequences, from the plugin's counters; `by_concurrency` has them at
  every concurrency;
- DSpark only: `skipped_draft_steps` (fraction of decode steps that ran no draft, per
  concurrency) and `ece` (the confidence head's expected calibration error, raw and
  recalibrated, over the proposer's recent verdicts at the end of the run).
`--json PATH` writes the issue's keys (`no_spec.tok_s`; `fixed` and `dspark`: `tok_s`,
`verified_per_step`, `accepted_per_step`; `dspark.ece`, `dspark.skipped_draft_steps`);
stdout has everything, with `by_concurrency`, the ratios and whether greedy outputs were
identical. The trained pair (fixtures/trained.py's full recipe, `make trained-pair`; the
tests' quick one with `--recipe quick`) is written first if absent.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fixtures/, tools/

MODES = {"no_spec": None, "fixed": "0", "dspark": "1"}  # DEEPINFER_ENABLE_MTP_VARLEN
CONCURRENCY = (1, 16, 64)
MIN_PROMPTS = 12
DRAFTS = 5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipe",
        choices=("full", "quick"),
        default="full",
        help="the trained pair's recipe (fixtures/trained.py): full, the "
        "one the figures are for, or quick, the default tests'",
    )
    parser.add_argument(
        "--model",
        help="the trained pair's directory (trained there if "
        "absent; default checkpoints/trained-v41-dspark, "
        "...-quick for the quick recipe)",
    )
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2, help="timed repeats (best)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    return parser.parse_args()


def counters(llm) -> dict[str, float]:
    """The plugin's DSpark counters (totals) and gauges (by label), by short name."""
    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith("deepinfer:spec_decode") or "position" in metric.labels:
            continue
        name = metric.name.split("spec_decode_")[1]
        label = metric.labels.get("confidence") or metric.labels.get("figure")
        values[name if label is None else f"{name}_{label}"] = metric.value
    return values


def measure(
    model: str, varlen: str | None, prompts: list[list[int]], new_tokens: int, rounds: int
) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_deepinfer import envs

    spec = None if varlen is None else {"method": "dspark", "num_speculative_tokens": DRAFTS}
    with envs.overridden(DEEPINFER_ENABLE_MTP_VARLEN=varlen or "1"):
        llm = LLM(
            model=model,
            dtype="float32",
            max_model_len=1024,
            block_size=16,
            seed=0,
            max_num_seqs=max(CONCURRENCY),
            max_num_batched_tokens=2048,
            speculative_config=spec,
            disable_log_stats=False,
        )
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    result: dict = {"tok_s": {}, "by_concurrency": {}}
    try:
        llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts[:4]], params, use_tqdm=False
        )  # warm up (and let the cost model see steps)
        for n in CONCURRENCY:
            # At least MIN_PROMPTS prompts (every span kind), n at a time.
            total = max(n, MIN_PROMPTS)
            batch = [TokensPrompt(prompt_token_ids=prompts[i % len(prompts)]) for i in range(total)]
            best = 0.0
            before = counters(llm)
            for _ in range(rounds):
                start = time.perf_counter()
                outputs = []
                for first in range(0, total, n):
                    outputs += llm.generate(batch[first : first + n], params, use_tqdm=False)
                seconds = time.perf_counter() - start
                generated = sum(len(o.outputs[0].token_ids) for o in outputs)
                best = max(best, generated / seconds)
            result["tok_s"][str(n)] = round(best, 2)
            if spec is not None:
                after = counters(llm)
                delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                request_steps = max(delta["request_steps"], 1)
                calibrated = max(delta["calibrated_drafts"], 1)
                result["by_concurrency"][str(n)] = {
                    "verified_per_step": round(delta["verified_tokens"] / request_steps, 3),
                    "accepted_per_step": round(delta["accepted_tokens"] / request_steps, 3),
                    "skipped_draft_steps": round(
                        delta["skipped_draft_steps"] / max(delta["decode_steps"], 1), 3
                    ),
                    "mean_confidence": round(delta["confidence_sum"] / calibrated, 3),
                    "observed_acceptance": round(delta["calibrated_accepted"] / calibrated, 3),
                }
        if spec is not None:
            headline = result["by_concurrency"][str(max(CONCURRENCY))]
            result["verified_per_step"] = headline["verified_per_step"]
            result["accepted_per_step"] = headline["accepted_per_step"]
            result["skipped_draft_steps"] = {
                n: figures["skipped_draft_steps"] for n, figures in result["by_concurrency"].items()
            }
            final = counters(llm)
            result["ece"] = {
                kind: round(final[f"ece_{kind}"], 4) if f"ece_{kind}" in final else None
                for kind in ("raw", "calibrated")
            }
            result["cost_fit"] = {
                k: round(v, 4) for k, v in final.items() if k.startswith("cost_fit")
            }
        else:
            del result["by_concurrency"]
        result["outputs"] = [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.llm_engine.engine_core.shutdown()
    return result


def _measure_and_send(sender, *args) -> None:
    sender.send(measure(*args))


def measure_apart(mode: str, *args) -> dict:
    """`measure` in a fresh process (spawned: nothing of the engines before it)."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_measure_and_send, args=(sender, *args))
    process.start()
    sender.close()  # the child's copy is the only one left: its death ends recv()
    try:
        return receiver.recv()
    except EOFError:
        raise RuntimeError(f"the {mode} run's process ended without a result") from None
    finally:
        process.join()


def main() -> None:
    args = parse_args()
    from vllm_deepinfer.preload import reexec_with_preloads

    reexec_with_preloads()  # tcmalloc and Intel's OpenMP, as vLLM's CPU guide asks
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from fixtures.trained import checkpoint_dir, ensure_trained_pair, sample_prompts

    model = ensure_trained_pair(args.model or checkpoint_dir(args.recipe), args.recipe)
    by_kind: dict[str, list[list[int]]] = {}
    for kind, ids in sample_prompts(per_kind=16):
        by_kind.setdefault(kind, []).append(ids)
    # Kinds in turn, so that every batch mixes spans easy and hard to draft.
    prompts = [ids for group in zip(*by_kind.values()) for ids in group]
    results = {
        mode: measure_apart(mode, model, varlen, prompts, args.new_tokens, args.rounds)
        for mode, varlen in MODES.items()
    }
    same = all(results[m]["outputs"] == results["no_spec"]["outputs"] for m in MODES)
    for r in results.values():
        del r["outputs"]
    results["greedy_outputs_identical"] = same
    fixed, dspark = results["fixed"], results["dspark"]
    results["ratios"] = {
        "verified_vs_fixed": round(dspark["verified_per_step"] / fixed["verified_per_step"], 3),
        "accepted_vs_fixed": round(dspark["accepted_per_step"] / fixed["accepted_per_step"], 3),
        "tok_s_vs_fixed": {
            n: round(dspark["tok_s"][n] / fixed["tok_s"][n], 3) for n in dspark["tok_s"]
        },
        "tok_s_vs_no_spec": {
            n: round(dspark["tok_s"][n] / results["no_spec"]["tok_s"][n], 3)
            for n in dspark["tok_s"]
        },
    }
    print(json.dumps(results, indent=2))  # everything measured
    if args.json:  # the issue's keys only
        issue_keys = ("tok_s", "verified_per_step", "accepted_per_step")
        written = {
            mode: {k: v for k, v in results[mode].items() if k in issue_keys} for mode in MODES
        }
        written["dspark"]["ece"] = results["dspark"]["ece"]
        written["dspark"]["skipped_draft_steps"] = results["dspark"]["skipped_draft_steps"]
        with open(args.json, "w") as f:
            f.write(json.dumps(written, indent=2) + "\n")
        from plots import write_plot  # the PNG beside the JSON

        write_plot(
            args.json,
            "DSpark vs fixed-length verification vs no speculation",
            {
                "tokens/s": {
                    f"{n} seqs": {m: written[m]["tok_s"][n] for m in MODES}
                    for n in written["dspark"]["tok_s"]
                }
            },
        )
    if not same:
        sys.exit("greedy outputs differ between modes")


if __name__ == "__main__":
    main()
