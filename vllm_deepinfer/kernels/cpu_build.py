"""The plugin's C kernels (kernels/cpu/*.c): compiled once per machine with the system's C
compiler, for the CPU it runs on (-march=native), and cached (DEEPINFER_KERNEL_CACHE_DIR).

The library's name carries a hash of its source, the compiler's version and the CPU's
flags, so a new source or another CPU kind builds anew and processes sharing the cache
never load a library built for other hardware. A build goes to a temporary file and is
renamed into place, so concurrent first starts (TP ranks, DP engines) are safe. Where no
compiler works, `load` logs why once and returns None: the caller keeps its torch path.
The sources are plain C with OpenMP (no torch headers): a build takes about a second."""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache

import torch

from vllm_deepinfer import envs
from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)

SOURCES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu")
FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11")
NATIVE = "native"
ROW_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""Row dtypes the kernels take, as their `enum dtype` (cpu/bf16.h) numbers them."""
BUILD_TIMEOUT_S = 120  # generous: a first build may run beside a loaded machine's work


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    """What -march=native targets: the CPU model's flags (Linux), else the machine name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(compiler: str) -> str:
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    return done.stdout


@cache
def load(name: str, march: str = NATIVE) -> ctypes.CDLL | None:
    """kernels/cpu/<name>.c as a loaded library, built first if the cache lacks it; None
    (logged once) where it cannot be built or loaded. `march` is the compiler's target
    (tests build a baseline one too, to run the portable path)."""
    source = os.path.join(SOURCES, f"{name}.c")
    compiler = _compiler()
    if compiler is None:
        logger.warning(
            "No C compiler found (cc, gcc, clang or $CC): the plugin's %s kernel is not "
            "built and its torch path runs instead (slower). Install gcc to build it.",
            name,
        )
        return None
    with open(source, "rb") as f:
        text = f.read()
    # The shared headers a kernel includes change its build as much as its own source.
    for header in sorted(glob.glob(os.path.join(SOURCES, "*.h"))):
        with open(header, "rb") as f:
            text += f.read()
    flags = (*FLAGS, f"-march={march}")
    key = hashlib.sha256(
        b"\0".join(
            [text, " ".join(flags).encode(), _version(compiler).encode(), _cpu_flags().encode()]
        )
    ).hexdigest()[:16]
    cache_dir = envs.load().kernel_cache_dir
    path = os.path.join(cache_dir, f"{name}-{key}.so")
    if not os.path.exists(path):
        try:
            _build(compiler, flags, source, path)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning(
                "Building the plugin's %s kernel failed (%s): its torch path runs instead "
                "(slower). %s",
                name,
                " ".join([compiler, *flags, source]),
                detail.strip()[-2000:],
            )
            return None
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        logger.warning("Loading %s failed (%s): its torch path runs instead.", path, e)
        return None


def _build(compiler: str, flags: tuple[str, ...], source: str, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    logger.info("Building the plugin's %s kernel for this CPU (once): %s", source, path)
    fd, temporary = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, source, "-o", temporary, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
