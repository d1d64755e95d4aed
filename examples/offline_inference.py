"""Offline generation with DeepSeek V4.1 through stock vLLM and the vllm-deepinfer plugin.

    python examples/offline_inference.py                 # embedded tiny checkpoint, compiled
    python examples/offline_inference.py --model DIR     # any V4.1 checkpoint
    python examples/offline_inference.py --enforce-eager # eager: no compiling at the start
    python examples/offline_inference.py --check_structured_output
        # regex, JSON Schema and EBNF requests (DeepInfer's so_args); checks each output and
        # its EOS termination, prints a line per check, exits non-zero on any failure

The plugin registers itself through its entry point: nothing here imports it except to
build the embedded checkpoint when DIR holds none.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fixtures/, tools/

STRUCTURED_REQUESTS = [
    ("regex", r"(yes|no), because [a-z]{3,12}\."),
    (
        "json",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Hangzhou", "Lima"]},
                "temperature": {"type": "integer", "minimum": -40, "maximum": 50},
                "summary": {"type": "string", "minLength": 3, "maxLength": 20},
            },
            "required": ["city", "temperature", "summary"],
            "additionalProperties": False,
        },
    ),
    (
        "ebnf",
        'root ::= "SELECT " column " FROM " table ";"\n'
        'column ::= "id" | "name" | "*"\ntable ::= [a-z]+',
    ),
]
PROMPTS = [
    "The quick brown fox",
    "DeepSeek models use multi-head latent attention and",
    "def forward(self, input_ids, positions):",
    "你好，世界。",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="checkpoints/tiny-v41-flash",
        help="checkpoint directory (the tiny one is written there if missing)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--check_structured_output",
        action="store_true",
        help="run and check regex, JSON Schema and EBNF requests",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the model eager, as vLLM's --enforce-eager (by default V4.1 "
        "is compiled: minutes at the first start, then loaded from "
        "vLLM's compile cache)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from fixtures.tiny import ensure_checkpoint

    ensure_checkpoint(args.model)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    structured = {
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}
    }
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=1024,
        block_size=16,
        enable_prefix_caching=True,
        seed=0,
        enforce_eager=args.enforce_eager,
        **(structured if args.check_structured_output else {}),
    )
    if args.check_structured_output:
        sys.exit(check_structured_output(llm, args.max_tokens))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    for output in outputs:
        print(f"prompt:     {output.prompt!r}")
        print(f"completion: {output.outputs[0].text!r}")
        print(f"token ids:  {list(output.outputs[0].token_ids)}")
    print(
        f"{generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s "
        f"(batch of {len(PROMPTS)}, greedy)"
    )


def check_structured_output(llm, max_tokens: int) -> int:
    """One line per request: conforming and ended by EOS, or what is wrong. Returns the
    number of failures."""
    from tools.schema_conformance import conformance_error
    from vllm_deepinfer import envs
    from vllm_deepinfer.structured.compile_pool import GrammarCompilePool
    from vllm_deepinfer.structured.so_args import sampling_params

    requests = [{"schema_type": kind, "schema": schema} for kind, schema in STRUCTURED_REQUESTS]
    params = [
        sampling_params(so_args=so_args, temperature=0.0, max_tokens=max(max_tokens, 128))
        for so_args in requests
    ]
    # Grammars are compiled in a worker process before the requests are scheduled.
    pool = GrammarCompilePool(llm.llm_engine.vllm_config, envs.load().grammar_cache_dir)
    try:
        compiled = pool.compile_all(params)
    finally:
        pool.shutdown()
    for so_args, result in zip(requests, compiled):
        source = "cache" if result.cached else "compiled"
        print(f"grammar {so_args['schema_type']:5} {source} in {result.seconds * 1e3:.1f} ms")
    outputs = llm.generate(PROMPTS[: len(requests)], params)
    failures = 0
    for so_args, output in zip(requests, outputs):
        completion = output.outputs[0]
        problem = conformance_error(so_args, completion.text)
        if problem is None and completion.finish_reason != "stop":
            problem = f"ended by {completion.finish_reason}, not EOS"
        failures += problem is not None
        verdict = "OK  " if problem is None else "FAIL"
        print(
            f"{verdict} {so_args['schema_type']:5} {completion.text!r}"
            + ("" if problem is None else f": {problem}")
        )
    return failures


if __name__ == "__main__":
    main()
