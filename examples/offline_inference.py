"""Offline generation with DeepSeek V4.1 through stock vLLM and the vllm-deepinfer plugin.

    python examples/offline_inference.py                 # embedded tiny checkpoint
    python examples/offline_inference.py --model DIR     # any V4.1 checkpoint

The plugin registers itself through its entry point: nothing here imports it except to
build the embedded checkpoint when DIR holds none.
"""
import argparse
import os
import time

PROMPTS = [
    "The quick brown fox",
    "DeepSeek models use multi-head latent attention and",
    "def forward(self, input_ids, positions):",
    "你好，世界。",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/tiny-v41-flash",
                        help="checkpoint directory (the tiny one is written there if missing)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if not os.path.exists(os.path.join(args.model, "config.json")):
        from vllm_deepinfer.checkpoint.tiny import write_checkpoint

        print(f"writing the embedded tiny V4.1-Flash checkpoint to {args.model}")
        write_checkpoint(args.model)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=1024, enforce_eager=True,
              block_size=16, enable_prefix_caching=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    for output in outputs:
        print(f"prompt:     {output.prompt!r}")
        print(f"completion: {output.outputs[0].text!r}")
        print(f"token ids:  {list(output.outputs[0].token_ids)}")
    print(f"{generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s "
          f"(batch of {len(PROMPTS)}, greedy)")


if __name__ == "__main__":
    main()
