"""Workers and engine cores stop in order and leave quickly, on the CPU (docs/patches.md).

- Workers and engine cores ignore SIGINT once they serve: a terminal's Ctrl-C is the API
  server's to act on, which stops them as SIGTERM does (engine core, then its workers).
- A worker leaves a SIGTERM sent to the whole process group to its engine core, which
  stops it after aborting its requests; the executor's own escalation still ends it.
- An engine core's teardown ignores SIGTERM (upstream resets it to the default first,
  and the process manager's SIGTERM then killed it midway); the manager's kill remains.
- Workers get 15 s to exit (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, unless set).
- After a clean teardown both leave without the interpreter's finalization
  (vllm_deepinfer.process_exit): no exit GC scan, no nanobind leak report."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from typing import NamedTuple

from vllm_deepinfer import process_exit
from vllm_deepinfer.patches.base import (
    PatchUnavailable,
    installed,
    left_to_vllm,
    require_source,
    source_of,
    upstream_method,
    upstream_symbols,
)

UPSTREAM = (
    "vllm.v1.executor.multiproc_executor.WorkerProc.worker_busy_loop, "
    "vllm.v1.executor.multiproc_executor.WorkerProc.shutdown, "
    "vllm.v1.engine.core.EngineCoreProc.run_busy_loop, "
    "vllm.v1.engine.core.DPEngineCoreProc.run_busy_loop, "
    "vllm.v1.engine.core.EngineCore.shutdown, "
    "vllm.v1.engine.core.DPEngineCoreProc.shutdown"
)
_MARK = "_deepinfer_shutdown_processes"
LEFT_TO_VLLM = ""
# The executor's grace for its workers' exit on the CPU where the user set none (vLLM:
# 5 s): on a loaded machine a worker took longer, and was killed past 9 s.
WORKER_EXIT_GRACE_S = 15
_GRACE = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
# Set on a worker or engine core whose busy loop ended as a shutdown does.
_STOPPED_CLEANLY = "_deepinfer_stopped_cleanly"
# Set on an engine core process when its teardown begins.
_TEARING_DOWN = "_deepinfer_tearing_down"


class _Upstream(NamedTuple):
    worker_cls: type
    engine_core_cls: type  # EngineCoreProc
    dp_engine_core_cls: type
    base_engine_core_cls: type  # EngineCore


def _check_upstream() -> _Upstream:
    try:
        from vllm.v1.engine import core
        from vllm.v1.executor import multiproc_executor
    except ImportError as exc:
        raise PatchUnavailable(f"vLLM's engine modules cannot be imported ({exc})") from exc
    upstream = _Upstream(
        *upstream_symbols(
            (multiproc_executor, "WorkerProc"),
            (core, "EngineCoreProc"),
            (core, "DPEngineCoreProc"),
            (core, "EngineCore"),
        )
    )
    for cls, name, symbol in zip(
        (
            upstream.worker_cls,
            upstream.worker_cls,
            upstream.engine_core_cls,
            upstream.dp_engine_core_cls,
            upstream.base_engine_core_cls,
            upstream.dp_engine_core_cls,
        ),
        ("worker_busy_loop", "shutdown", "run_busy_loop", "run_busy_loop", "shutdown", "shutdown"),
        UPSTREAM.split(", "),
    ):
        upstream_method(cls, name, symbol)
    symbol = "vllm.v1.executor.multiproc_executor.WorkerProc.worker_main"
    require_source(
        upstream_method(upstream.worker_cls, "worker_main", symbol),
        symbol,
        (
            ("worker_busy_loop()", "serves in worker_busy_loop"),
            ("monitor_death_pipe(", "stops when the engine core closes its death pipe"),
        ),
    )
    symbol = "vllm.v1.engine.core.EngineCoreProc.run_engine_core"
    require_source(
        upstream_method(upstream.engine_core_cls, "run_engine_core", symbol),
        symbol,
        (("engine_core.shutdown()", "tears its engine core down after the busy loop"),),
    )
    if not process_exit.supported():
        raise PatchUnavailable("this Python's atexit lacks _run_exitfuncs/_ncallbacks")
    return upstream


def upstream_processes_stop_in_order(upstream: _Upstream) -> str:
    """Read from the source (these behaviours show only in running processes): upstream
    does it when its workers and engine cores no longer handle SIGINT, its engine core's
    teardown keeps its SIGTERM handler, and both leave without the exit's finalization."""
    engine_core_main = source_of(
        upstream.engine_core_cls.run_engine_core, "EngineCoreProc.run_engine_core"
    )
    worker_main = source_of(upstream.worker_cls.worker_main, "WorkerProc.worker_main")
    if (
        "signal.SIGINT" in worker_main
        or "signal.SIGINT" in engine_core_main
        or "signal.SIG_DFL" in engine_core_main
        or not all("os._exit(" in main for main in (worker_main, engine_core_main))
    ):
        return ""
    return (
        "leaves SIGINT to the API server, keeps the engine core's SIGTERM handler through "
        "its teardown, and ends its processes without the exit's finalization"
    )


def _wrap_busy_loop(original):
    """A worker's or an engine core's serving loop: deaf to SIGINT; records whether it
    ended as a shutdown does (SystemExit with status 0, or a worker's queue closed by its
    executor)."""

    @functools.wraps(original)
    def busy_loop(self, *args, **kwargs):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return original(self, *args, **kwargs)
        except SystemExit as exc:
            if exc.code in (None, 0):
                setattr(self, _STOPPED_CLEANLY, True)
            raise
        except Exception:
            queue = getattr(self, "rpc_broadcast_mq", None)
            if getattr(queue, "shutting_down", False):
                setattr(self, _STOPPED_CLEANLY, True)
            raise

    setattr(busy_loop, _MARK, True)
    return busy_loop


def _wrap_worker_busy_loop(original):
    """As `_wrap_busy_loop`, and deaf to a SIGTERM its engine core also received (one to
    the whole process group): ended mid-step, the worker made its engine core fail. A
    SIGTERM once the executor is stopping it, or once the engine core is gone, ends it as
    upstream does."""
    busy_loop = _wrap_busy_loop(original)

    @functools.wraps(original)
    def worker_busy_loop(self, *args, **kwargs):
        upstream_handler = signal.getsignal(signal.SIGTERM)
        engine_core = os.getppid()

        def on_sigterm(signum, frame):
            stopping = getattr(self.rpc_broadcast_mq, "shutting_down", True)
            if not stopping and os.getppid() == engine_core:
                return  # the engine core stops this worker through its executor
            if callable(upstream_handler):
                upstream_handler(signum, frame)
            else:
                raise SystemExit()

        signal.signal(signal.SIGTERM, on_sigterm)
        return busy_loop(self, *args, **kwargs)

    setattr(worker_busy_loop, _MARK, True)
    return worker_busy_loop


def _wrap_teardown(original, sigterm_deaf: bool):
    """A worker's or engine core's teardown after its busy loop (on the main thread; a
    nested call, the DP engine core's to its base's, leaves the outer one in charge). An
    engine core's ignores SIGTERM until it ends. Once a teardown after a clean stop has
    returned, the process leaves without the interpreter's finalization."""

    @functools.wraps(original)
    def shutdown(self, *args, **kwargs):
        if (
            getattr(self, _TEARING_DOWN, False)
            or threading.current_thread() is not threading.main_thread()
        ):
            return original(self, *args, **kwargs)
        setattr(self, _TEARING_DOWN, True)
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if sigterm_deaf else None
        try:
            result = original(self, *args, **kwargs)
        finally:
            if sigterm_deaf:
                signal.signal(signal.SIGTERM, previous)
        if getattr(self, _STOPPED_CLEANLY, False):
            process_exit.leave_after_exit_handlers(0)
        return result

    setattr(shutdown, _MARK, True)
    return shutdown


def apply() -> bool:
    """Idempotent; True once installed, False off the CPU or where upstream's processes
    already stop in order."""
    from vllm.platforms import current_platform

    global LEFT_TO_VLLM
    upstream = _check_upstream()
    if not current_platform.is_cpu():
        return False
    if installed(upstream.worker_cls.worker_busy_loop, _MARK):
        return True
    does = upstream_processes_stop_in_order(upstream)
    if does:
        return left_to_vllm(sys.modules[__name__], does)
    LEFT_TO_VLLM = ""
    # Inherited by the engine cores, whose executors read it when they stop their workers.
    os.environ.setdefault(_GRACE, str(WORKER_EXIT_GRACE_S))
    worker_cls = upstream.worker_cls
    worker_cls.worker_busy_loop = _wrap_worker_busy_loop(worker_cls.worker_busy_loop)
    worker_cls.shutdown = _wrap_teardown(worker_cls.shutdown, sigterm_deaf=False)
    for cls in (upstream.engine_core_cls, upstream.dp_engine_core_cls):
        cls.run_busy_loop = _wrap_busy_loop(cls.__dict__["run_busy_loop"])
        # EngineCoreProc inherits EngineCore's teardown; DPEngineCoreProc extends it.
        cls.shutdown = _wrap_teardown(
            cls.__dict__.get("shutdown", upstream.base_engine_core_cls.shutdown), sigterm_deaf=True
        )
    return True
