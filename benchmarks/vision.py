"""The vision path, measured side by side in one in-process engine (fp32, CPU):

- the vision tower (upstream's ViT and aligner as the plugin loads them, with the image-span
  vectors): images per second at two sizes, on patches preprocessed beforehand;
- time to first token of an image request against a text-only request of the same prompt
  length (the image's span counted), alternating, a fresh image and fresh text every
  round, prefix caching off: the image request pays preprocessing, the encoder and the
  prefill of its span, the text one the prefill only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fixtures/, tools/

SIZES = ((112, 112), (448, 448))
"""Sent sizes. The tiny checkpoint's token budget (64) shrinks the larger one to 196x196
pixels (14x14 patches, a 7x7 grid of merged cells)."""
TEXT_TOKENS = 64
ENCODER_BATCH = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="checkpoints/tiny-v41-flash-vl",
        help="a V4.1 checkpoint with a vision tower (the tiny one is written if absent)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="timed repeats (median)")
    parser.add_argument("--json", metavar="PATH", help="also write the keys to PATH")
    return parser.parse_args()


def noise_image(width: int, height: int, seed: int):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def encoder_images_per_s(llm, size: tuple[int, int], rounds: int) -> tuple[float, str]:
    """Median images/s of `encode_image` over ENCODER_BATCH distinct images of `size`, and
    the size the preprocessing gave them."""
    images = [noise_image(*size, seed) for seed in range(ENCODER_BATCH)]

    def run(model):
        from vllm.models.deepseek_v41.common.mm_preprocess import (
            DeepseekV4VLImageProcessor,
            image_token_types,
        )

        preprocess = DeepseekV4VLImageProcessor(model.config)
        prepared = []
        for image in images:
            patches, h, w, rows, cols = preprocess(image)
            prepared.append((patches, (h, w), image_token_types(rows, cols)))
        timings = []
        for _ in range(rounds):
            start = time.perf_counter()
            for patches, grid, types in prepared:
                model.encode_image(patches, grid, types)
            timings.append(len(prepared) / (time.perf_counter() - start))
        h, w = prepared[0][1]
        p = model.config.vision_patch_size
        return statistics.median(timings), f"{w * p}x{h * p} px, {h * w} patches"

    [result] = llm.apply_model(run)
    return result


def ttft_s(llm, rounds: int, span: int) -> tuple[float, float]:
    """Median seconds to the first token: image request, text-only of the same length."""
    from vllm import SamplingParams

    from vllm_deepinfer.model.deepseek_v41.args import IMAGE_TOKEN_ID

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    times = {"image": [], "text": []}

    def timed(prompt) -> float:
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    for round_number in range(rounds + 1):  # the first round warms up, uncounted
        text = [rng.randrange(3, 800) for _ in range(TEXT_TOKENS)]
        ids = text[: TEXT_TOKENS // 2] + [IMAGE_TOKEN_ID] + text[TEXT_TOKENS // 2 :]
        image = noise_image(*SIZES[-1], 1000 + round_number)
        with_image = timed({"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}})
        text_only = timed(
            {"prompt_token_ids": [rng.randrange(3, 800) for _ in range(TEXT_TOKENS + span)]}
        )
        if round_number:
            times["image"].append(with_image)
            times["text"].append(text_only)
    return statistics.median(times["image"]), statistics.median(times["text"])


def main() -> int:
    args = parse_args()
    from vllm_deepinfer.preload import reexec_with_preloads

    reexec_with_preloads()  # tcmalloc and Intel's OpenMP, as vLLM's CPU guide asks
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model in-process
    from vllm import LLM
    from vllm.transformers_utils.configs.deepseek_v41 import DeepseekV41Config

    from fixtures.tiny import write_checkpoint
    from vllm_deepinfer.model.deepseek_v41.image_processing import image_span_length

    if not os.path.exists(os.path.join(args.model, "config.json")):
        write_checkpoint(args.model, vision=True)
    with open(os.path.join(args.model, "config.json")) as f:
        config = DeepseekV41Config(**json.load(f))
    span = image_span_length(config, SIZES[-1])
    llm = LLM(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=1024,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
    )

    encoder = {}
    for size in SIZES:
        per_s, processed = encoder_images_per_s(llm, size, args.rounds)
        encoder[f"{size[0]}x{size[1]}"] = per_s
        print(f"vision tower, {size[0]}x{size[1]} sent ({processed}): {per_s:.1f} images/s")
    image_s, text_s = ttft_s(llm, args.rounds, span)
    print(
        f"time to first token, {TEXT_TOKENS + span}-token prompts (one image = {span} "
        f"tokens): image {image_s * 1000:.1f} ms, text only {text_s * 1000:.1f} ms "
        f"({image_s / text_s:.2f}x)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "vision_encoder_images_per_s": encoder,
                    "ttft_s": {"image": image_s, "text": text_s},
                },
                f,
                indent=1,
            )
        from plots import write_plot  # the PNG beside the JSON

        write_plot(
            args.json,
            "Vision encoder and image time to first token",
            {
                "images/s through the vision tower": {"": encoder},
                "time to first token, s": {"": {"image": image_s, "text only": text_s}},
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
