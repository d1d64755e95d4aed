"""How far bounded and decoder-side replay move the output, against `keep`.

For prompts of 1k and 4k tokens whose cache holds every full block (the hit N is the
largest multiple of 16 below the prompt length), the reference forward
(`ReferenceV41.logits` with the replay semantics, fp32) gives the last position's
log-probabilities three ways: exact (no replay), bounded replay from N - keep, and bounded
plus decoder-side replay (layers after the last kv source on the last `keep` rows), as the
engine runs. Printed per keep (W, W + 12, 2W, 4W, the exact bound layers x (W - 1)): the
largest |delta log-probability| over the vocabulary, the |delta| of the exact forward's
top token, and whether the top token stays the same. Then the fidelity cost of the
release's global KV precisions (NVFP4 latents, MXFP4 index keys; no replay) the same way.

Last, chained hits: a replayed admission's compressed KV is approximate and stays cached,
so a hit on the blocks it wrote replays on top of it. For prompts that each hit the
blocks the previous one wrote (hits of 352, 400 and 448 tokens: 1, 2 and 3 replays deep),
at the default keep and at W + 8: over the rows each computes past its hit, the mean and
largest |delta log-probability| of the exact forward's top token against the exact
forward, the largest against a single replay of an exact prefix (what reusing replayed
KV adds), and how many rows change their top token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fixtures/, tools/

PROMPT_LENGTHS = (1024, 4096)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="checkpoints/tiny-v41-flash")
    parser.add_argument("--json", metavar="PATH", help="also write the table to PATH")
    args = parser.parse_args()
    from fixtures.reference import ReferenceV41
    from fixtures.tiny import write_checkpoint
    from vllm_deepinfer.envs import DEFAULT_KEEP_TOKENS
    from vllm_deepinfer.kv_cache.precision import MXFP4_INDEX_KEY, NVFP4_LATENT

    if not os.path.exists(os.path.join(args.model, "config.json")):
        write_checkpoint(args.model)
    reference = ReferenceV41(args.model, dtype=torch.float32)
    release = ReferenceV41(args.model, dtype=torch.float32, records=(NVFP4_LATENT, MXFP4_INDEX_KEY))
    a = reference.args
    W = a.sliding_window
    keeps = {
        "W": W,
        "W+12": W + 12,
        "2W": 2 * W,
        "4W": 4 * W,
        "bound": a.num_hidden_layers * (W - 1),
    }
    generator = torch.Generator().manual_seed(0)
    table = {}
    print(f"{'prompt':>6} {'keep':>10} | {'bounded replay':^30} | {'+ decoder-side replay':^30}")
    for length in PROMPT_LENGTHS:
        tokens = torch.randint(3, 800, (length,), generator=generator).tolist()
        hit = (length - 1) // 16 * 16
        exact = reference.logits(tokens, last_rows=1)[-1].log_softmax(-1)
        for name, keep in keeps.items():
            row = {}
            for mode, kept_from in (("bounded", 0), ("with_decoder", length - keep)):
                row[mode] = _compared(
                    reference.logits(
                        tokens, replays=[(hit - keep, hit)], kept_from=kept_from, last_rows=1
                    )[-1],
                    exact,
                )
            table[f"{length}/{name}"] = row
            print(
                f"{length:>6} {name + f' ({keep})':>10} | " + " | ".join(map(_cell, row.values())),
                flush=True,
            )
        table[f"{length}/release_precision"] = cost = _compared(
            release.logits(tokens, last_rows=1)[-1], exact
        )
        print(f"{length:>6} release precisions, no replay: {_cell(cost)}", flush=True)
    for keep in (DEFAULT_KEEP_TOKENS, W + 8):
        for depth, row in enumerate(_chained_hits(reference, keep), start=1):
            table[f"chain/{keep}/{depth}"] = row
            print(
                f"keep {keep}, hit {depth} replay(s) deep: top token |delta| mean "
                f"{row['mean_abs']:.2e} max {row['max_abs']:.2e}; beyond a single replay "
                f"max {row['beyond_single_max_abs']:.2e}; top token changed on "
                f"{row['changed_top']} of {row['rows']} rows",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=2)
        from plots import write_plot  # the PNG beside the JSON

        panels = {
            f"{n}-token prompt: |delta|": {
                f"{k} ({keep})": {
                    mode: table[f"{n}/{k}"][mode]["top_token_abs"]
                    for mode in ("bounded", "with_decoder")
                }
                for k, keep in keeps.items()
            }
            for n in PROMPT_LENGTHS
        }
        write_plot(
            args.json,
            "Replay against exact: |delta log-prob| of the exact top token",
            panels,
            log_scale=panels,
        )


CHAIN_HITS = (352, 400, 448)
CHAIN_TAIL = 48  # tokens each prompt adds after its hit: the next hit covers 3 new blocks
CHAIN_PROMPTS = 3


def _chained_hits(reference, keep: int) -> list[dict]:
    """Per depth, over CHAIN_PROMPTS chains: the top-token deltas of the rows past each
    hit against the exact forward and against a single replay (see the module doc)."""
    generator = torch.Generator().manual_seed(1)
    rows = [{"exact": [], "single": [], "changed": 0} for _ in CHAIN_HITS]
    for _ in range(CHAIN_PROMPTS):
        prompt = torch.randint(3, 800, (CHAIN_HITS[0] + 4 * 16,), generator=generator).tolist()
        for depth, hit in enumerate(CHAIN_HITS):
            tail = torch.randint(3, 800, (CHAIN_TAIL,), generator=generator).tolist()
            prompt, n = prompt[:hit] + tail, CHAIN_TAIL
            exact = reference.logits(prompt, last_rows=n).log_softmax(-1)
            chain = [(h - keep, h) for h in CHAIN_HITS[: depth + 1]]
            chained = reference.logits(prompt, replays=chain, last_rows=n).log_softmax(-1)
            single = reference.logits(prompt, replays=chain[-1:], last_rows=n).log_softmax(-1)
            top = exact.argmax(-1, keepdim=True)
            rows[depth]["exact"] += (chained - exact).gather(1, top).abs().flatten().tolist()
            rows[depth]["single"] += (chained - single).gather(1, top).abs().flatten().tolist()
            rows[depth]["changed"] += int((chained.argmax(-1) != top[:, 0]).sum())
    return [
        {
            "rows": len(r["exact"]),
            "mean_abs": sum(r["exact"]) / len(r["exact"]),
            "max_abs": max(r["exact"]),
            "beyond_single_max_abs": max(r["single"]),
            "changed_top": r["changed"],
        }
        for r in rows
    ]


def _compared(logits: torch.Tensor, exact: torch.Tensor) -> dict:
    """Against the exact forward's log-probabilities: the largest |delta|, the |delta| of the
    exact top token, and whether the top token stays."""
    delta = (logits.log_softmax(-1) - exact).abs()
    top = int(exact.argmax())
    return {
        "max_abs": delta.max().item(),
        "top_token_abs": delta[top].item(),
        "same_top": int(logits.argmax()) == top,
    }


def _cell(row: dict) -> str:
    return (
        f"max {row['max_abs']:.2e} top {row['top_token_abs']:.2e} "
        f"{'same' if row['same_top'] else 'DIFF'}"
    )


if __name__ == "__main__":
    main()
