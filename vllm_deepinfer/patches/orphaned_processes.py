"""No worker or engine core outlives what started it (docs/patches.md).

- A process that owns a multiprocessing executor stops its workers before
  multiprocessing's exit joins them. Upstream left that to a weakref finalizer, which runs
  after the join: an engine core whose start failed (too little memory for the KV space
  asked, say) waited forever for workers that waited on its death pipe, and the client's
  wait for the start (`LLM(...)`, `vllm serve`) never returned.
- An engine core started by multiprocessing stops, as its process manager's SIGTERM would
  stop it, once the process that started it is gone (a killed `LLM` owner or API server).
  Upstream never noticed: the engine core and its workers kept running, holding their
  memory."""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import signal
import sys
import threading
import weakref
from typing import NamedTuple

from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.patches.base import (
    PatchUnavailable,
    installed,
    left_to_vllm,
    source_of,
    upstream_method,
    upstream_symbols,
)

logger = init_logger(__name__)

UPSTREAM = (
    "vllm.v1.executor.multiproc_executor.MultiprocExecutor._init_executor, "
    "vllm.v1.engine.core.EngineCoreProc.run_busy_loop, "
    "vllm.v1.engine.core.DPEngineCoreProc.run_busy_loop"
)
_MARK = "_deepinfer_orphaned_processes"
LEFT_TO_VLLM = ""
# multiprocessing's exit runs finalizers of this priority or higher before joining children.
_BEFORE_THE_JOIN = 0


class _Upstream(NamedTuple):
    executor_cls: type
    engine_core_cls: type  # EngineCoreProc
    dp_engine_core_cls: type


def _check_upstream() -> _Upstream:
    try:
        from vllm.v1.engine import core
        from vllm.v1.executor import multiproc_executor
    except ImportError as exc:
        raise PatchUnavailable(f"vLLM's engine modules cannot be imported ({exc})") from exc
    upstream = _Upstream(
        *upstream_symbols(
            (multiproc_executor, "MultiprocExecutor"),
            (core, "EngineCoreProc"),
            (core, "DPEngineCoreProc"),
        )
    )
    names = ("_init_executor", "run_busy_loop", "run_busy_loop")
    for cls, name, symbol in zip(upstream, names, UPSTREAM.split(", ")):
        upstream_method(cls, name, symbol)
    upstream_method(upstream.executor_cls, "shutdown", "MultiprocExecutor.shutdown")
    return upstream


def upstream_stops_orphans(upstream: _Upstream) -> str:
    """Read from the source (both show only in running processes and at their exit):
    upstream does it when its executor registers a multiprocessing finalizer and its
    engine core process watches its parent."""
    executor_init = source_of(upstream.executor_cls._init_executor, UPSTREAM.split(", ")[0])
    process_main = source_of(
        upstream.engine_core_cls.run_engine_core, "EngineCoreProc.run_engine_core"
    )
    watches_parent = any(
        watch in process_main for watch in ("parent_process(", "PR_SET_PDEATHSIG", "getppid(")
    )
    if "util.Finalize(" not in executor_init or not watches_parent:
        return ""
    return "stops its workers before its exit joins them, and its engine cores watch their parent"


def _stop_workers_if_alive(executor_ref) -> None:
    executor = executor_ref()
    if executor is not None and not getattr(executor, "shutting_down", False):
        logger.info("Stopping this process's workers before it exits.")
        executor.shutdown()


def _wrap_init_executor(original):
    """Once the executor has started its workers, it stops them at the process's exit before
    multiprocessing joins them (its shutdown is idempotent; a weak reference, so the
    executor is freed as before)."""

    @functools.wraps(original)
    def init_executor(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        multiprocessing.util.Finalize(
            None, _stop_workers_if_alive, args=(weakref.ref(self),), exitpriority=_BEFORE_THE_JOIN
        )
        return result

    setattr(init_executor, _MARK, True)
    return init_executor


def stop_when_parent_dies() -> bool:
    """In a multiprocessing child: a daemon thread waits on the parent's sentinel and, once
    the parent is gone, sends this process SIGTERM. False elsewhere (an engine core in a
    Ray actor), where nothing is started."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return False

    def wait_for_parent():
        multiprocessing.connection.wait([parent.sentinel])
        logger.warning(
            "The process that started this engine core (pid %s) is gone; stopping.", parent.pid
        )
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait_for_parent, daemon=True, name="DeepInferParentWatch").start()
    return True


def _wrap_busy_loop(original):
    """An engine core's serving loop, with the parent watch started first (a parent that
    died during the construction is seen at once)."""

    @functools.wraps(original)
    def busy_loop(self, *args, **kwargs):
        stop_when_parent_dies()
        return original(self, *args, **kwargs)

    setattr(busy_loop, _MARK, True)
    return busy_loop


def apply() -> bool:
    """Idempotent; True once installed, False where upstream already stops its orphans."""
    global LEFT_TO_VLLM
    upstream = _check_upstream()
    executor_cls = upstream.executor_cls
    if installed(executor_cls._init_executor, _MARK):
        return True
    does = upstream_stops_orphans(upstream)
    if does:
        return left_to_vllm(sys.modules[__name__], does)
    LEFT_TO_VLLM = ""
    executor_cls._init_executor = _wrap_init_executor(executor_cls._init_executor)
    for cls in (upstream.engine_core_cls, upstream.dp_engine_core_cls):
        cls.run_busy_loop = _wrap_busy_loop(cls.__dict__["run_busy_loop"])
    return True
