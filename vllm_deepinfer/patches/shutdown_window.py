"""The engine core's teardown window at a server's stop, on the CPU (docs/patches.md).

In abort mode (`--shutdown-timeout 0`, the default) vLLM's process manager force-kills
the engine core at once on the CPU; the patch gives it `teardown_window_s()` to abort its
requests, stop its workers and exit, on whichever path stops it, and returns as soon as it
has exited. Skipped where the probe (upstream's own process manager, run on a stand-in
process) finds vLLM waits at least as long."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from types import SimpleNamespace
from typing import NamedTuple

from vllm_deepinfer.patches.base import (
    PatchUnavailable,
    installed,
    left_to_vllm,
    parameter_names,
    require_source,
    upstream_method,
)

UPSTREAM = "vllm.v1.engine.utils.CoreEngineProcManager.shutdown"
_MARK = "_deepinfer_shutdown_window"
LEFT_TO_VLLM = ""  # what vLLM does instead, where the probe found it waits long enough

# The model step under way when the signal lands, which the engine core finishes before it
# aborts (6 s measured on a loaded 2-core machine); the executor's wait after the SIGTERM
# it sends to workers past their grace; the engine core's own exit.
_STEP_S, _EXECUTOR_SIGTERM_WAIT_S, _MARGIN_S = 10.0, 4.0, 5.0


def teardown_window_s() -> float:
    """Seconds the engine core gets to abort its requests, stop its workers and exit: the
    step under way, the workers' exit grace (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, which
    shutdown_processes defaults to 15 on the CPU), the executor's SIGTERM wait, its exit."""
    import vllm.envs as envs

    return (
        _STEP_S + envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS + _EXECUTOR_SIGTERM_WAIT_S + _MARGIN_S
    )


class _Upstream(NamedTuple):
    manager_cls: type
    shutdown: object  # CoreEngineProcManager.shutdown as upstream wrote it


def _check_upstream() -> _Upstream:
    try:
        from vllm.v1.engine import core, utils
    except ImportError as exc:
        raise PatchUnavailable(f"vLLM's engine modules cannot be imported ({exc})") from exc
    manager_cls = getattr(utils, "CoreEngineProcManager", None)
    if manager_cls is None:
        raise PatchUnavailable("vllm.v1.engine.utils.CoreEngineProcManager is missing")
    shutdown = upstream_method(manager_cls, "shutdown", UPSTREAM)
    if parameter_names(shutdown) != ["self", "timeout"]:
        raise PatchUnavailable(f"{UPSTREAM} no longer takes (self, timeout)")
    engine_core_cls = getattr(core, "EngineCoreProc", None)
    if engine_core_cls is None:
        raise PatchUnavailable("vllm.v1.engine.core.EngineCoreProc is missing")
    symbol = "vllm.v1.engine.core.EngineCoreProc._handle_shutdown"
    require_source(
        upstream_method(engine_core_cls, "_handle_shutdown", symbol),
        symbol,
        (("_send_abort_outputs(", "aborts in-flight requests on a shutdown request"),),
    )
    return _Upstream(manager_cls, inspect.unwrap(shutdown))


class _ProbeProcess:
    """An engine core process as the process manager's shutdown sees it: alive until it
    is waited for. No pid, so nothing is ever killed."""

    name, pid = "deepinfer-shutdown-window-probe", None

    def __init__(self):
        self.alive, self.terminated, self.waited = True, False, 0.0

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        self.terminated = True

    def join(self, timeout=None) -> None:
        self.waited, self.alive = timeout or 0.0, False


class _Finalizer:
    alive = True

    def detach(self):
        return (None, None, (), {})


@contextlib.contextmanager
def _quiet(*names: str):
    """The probe's stand-in is not worth the process manager's log lines."""
    loggers = [logging.getLogger(name) for name in names]
    before = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, disabled in zip(loggers, before):
            logger.disabled = disabled


def upstream_window_s(upstream: _Upstream) -> float:
    """The probe: how long upstream's process manager waits for an engine core in abort
    mode before it kills it, measured by running its shutdown on a stand-in manager."""
    process = _ProbeProcess()
    manager = SimpleNamespace(
        _request_shutdown_timeout=0,
        _finalizer=_Finalizer(),
        manager_stopped=threading.Event(),
        processes=[process],
    )
    try:
        with _quiet("vllm.v1.utils", "vllm.v1.engine.utils"):
            upstream.shutdown(manager, 0)
    except Exception as exc:  # noqa: BLE001 - whatever changed, the probe cannot tell
        raise PatchUnavailable(
            f"{UPSTREAM} cannot be probed on a stand-in manager ({type(exc).__name__}: {exc})"
        ) from exc
    if not process.terminated:
        raise PatchUnavailable(
            f"{UPSTREAM} no longer stops the engine core process (no SIGTERM to a stand-in)"
        )
    return round(process.waited, 1)


def _wrap_manager_shutdown(original):
    @functools.wraps(original)
    def shutdown(self, timeout=None):
        if self._request_shutdown_timeout == 0:
            # Abort mode: whichever path stops the engine core first (the API server's
            # signal handler with 0, the client's clean-up or finalizer with upstream's
            # 5 or 15 s) gives it the window; the wait ends when it has exited.
            timeout = max(timeout or 0, teardown_window_s())
        return original(self, timeout)

    setattr(shutdown, _MARK, True)
    return shutdown


def apply() -> bool:
    """Idempotent; True once installed, False off the CPU or where vLLM's window is as
    long as the patch's."""
    import sys

    from vllm.platforms import current_platform

    upstream = _check_upstream()
    if not current_platform.is_cpu():
        return False
    if installed(upstream.manager_cls.shutdown, _MARK):
        return True
    upstream_window, window = upstream_window_s(upstream), teardown_window_s()
    if upstream_window >= window:
        return left_to_vllm(
            sys.modules[__name__],
            f"waits {upstream_window:g} s for the "
            f"engine core after the abort (the patch's window: {window:g} s)",
        )
    global LEFT_TO_VLLM
    LEFT_TO_VLLM = ""
    upstream.manager_cls.shutdown = _wrap_manager_shutdown(upstream.manager_cls.shutdown)
    return True
