"""Segmented parallel prompt tokenization against deepseek-recipe's sequential encoding,
on prompts of 100k+ characters, measured side by side in one run.

    python benchmarks/tokenization.py [--model DIR] [--repeats 15]

Each round times both encoders on the same converted request, alternating which goes
first; the figure is the median over the rounds. Ids are checked to be identical.
"""

import argparse
import json
import os
import random
import statistics
import sys
import time

import deepseek_recipe as dr

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fixtures/, tools/

from fixtures.tokenizer import _CORPUS
from vllm_deepinfer.serving.prompts import PromptEncoder


def conversations(rng: random.Random) -> dict[str, dict]:
    words = _CORPUS.split()

    def text(n_words: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n_words))

    turns = []
    for i in range(40):
        turns.append({"role": "user" if i % 2 == 0 else "assistant", "content": text(700)})
    return {
        "one long user message": {"messages": [{"role": "user", "content": text(40_000)}]},
        "40-turn conversation": {"messages": [{"role": "system", "content": text(500)}] + turns},
        "code and CJK": {
            "messages": [
                {
                    "role": "user",
                    "content": (
                        "def forward(self, x):\n    return self.norm(x)  # 你好，世界。深度求索\n"
                        * 2500
                    ),
                }
            ]
        },
    }


def timed(fn) -> tuple[float, list[int]]:
    start = time.perf_counter()
    ids = fn()
    return time.perf_counter() - start, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="checkpoints/tiny-v41-flash",
        help="checkpoint dir whose tokenizer.json is used (written if missing)",
    )
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    from fixtures.tiny import ensure_checkpoint

    encoder = PromptEncoder(ensure_checkpoint(args.model))
    options = dr.ConversionOptions()
    print(
        f"{'prompt':24} {'chars':>8} {'tokens':>8} {'sequential ms':>14} "
        f"{'parallel ms':>12} {'speed-up':>9}"
    )
    for name, body in conversations(random.Random(0)).items():
        request = dr.ChatCompletionRequest(json.dumps({"model": "DeepSeek-V4.1-Flash", **body}))
        conversation = request.convert(options).conversation
        chars = len(encoder.encoding.render_conversation(conversation).prompt)
        sequential, parallel = [], []
        for round_ in range(args.repeats):
            order = [("seq", encoder.encode_sequential), ("par", encoder.encode)]
            if round_ % 2:
                order.reverse()
            results = {}
            for label, fn in order:
                seconds, ids = timed(lambda: fn(conversation))  # noqa: B023 - called here
                results[label] = ids
                (sequential if label == "seq" else parallel).append(seconds)
            if results["seq"] != results["par"]:
                raise SystemExit(f"{name}: parallel ids differ from sequential ids")
        seq_ms = statistics.median(sequential) * 1e3
        par_ms = statistics.median(parallel) * 1e3
        print(
            f"{name:24} {chars:8d} {len(results['seq']):8d} {seq_ms:14.1f} {par_ms:12.1f} "
            f"{seq_ms / par_ms:8.2f}x"
        )
    print(
        f"median of {args.repeats} alternating rounds; {os.cpu_count()} CPUs; "
        "ids identical in every round"
    )


if __name__ == "__main__":
    main()
