"""A clean `vllm serve` shutdown on SIGTERM and SIGINT on the CPU.

Why: on either signal the API server stops the engine client with the request timeout
(`--shutdown-timeout`, default 0: "abort" mode), and three things go wrong on the CPU:
- `CoreEngineProcManager.shutdown(timeout=0)` sends the engine core SIGTERM and, with no
  time left, force-kills it and its workers at once (upstream grants a teardown window
  after the abort on ROCm only, `get_engine_process_shutdown_timeout`). The engine core
  never aborts its in-flight requests, so their HTTP connections hang, and its and its
  workers' shared-memory queues and semaphores are left to the resource tracker
  ("leaked shared_memory" / "leaked semaphore" warnings).
- Once the engine core has exited, `AsyncLLM.shutdown` closes the client's sockets and
  cancels its output handler as two separate callbacks on the event loop; when the loop
  runs between them, the handler receives the EngineDeadError the closed output queue
  leaves behind and logs "AsyncLLM output_handler failed" with a traceback, on a clean
  stop.
- Ctrl-C sends SIGINT to the whole process group. The worker's handler raises SystemExit
  wherever it is, also in the middle of a model step, so the engine core, which got the
  same SIGINT and was about to abort its requests, finds its worker dead, dies with a
  fatal error and fails every in-flight request with EngineDeadError.

How (on the CPU platform only):
- A zero process timeout in abort mode becomes a teardown window: the engine core aborts
  every in-flight request at once (each ends with finish reason `abort`, which the front
  ends answer with an error), stops its workers and exits; the process manager waits up
  to the window (returning as soon as the engine core has exited) and force-kills only
  past it. The window is what the engine core's executor may itself take to stop its
  workers (`VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`, then SIGTERM and up to 4 s more) plus
  a margin. A user's `--shutdown-timeout` (drain mode) is left as it is.
- `AsyncLLM.shutdown` asks the process manager, once the engine core has exited and
  before the client goes on to close its sockets, to wait briefly until every request has
  received its final output, to fail those still without one (the engine core had to be
  killed) with EngineDeadError, as the output handler does for a dead engine (upstream's
  race can also cancel the handler before it sees the dead engine: those requests then
  hang), and then to cancel the output handler.
- Workers ignore SIGINT once they serve: the engine core, which receives the same
  terminal SIGINT, stops them through its executor (the death pipe), after its own abort.
  SIGTERM keeps upstream's handling (the executor's escalation uses it).

Upstream symbols: vllm.v1.engine.utils.CoreEngineProcManager.shutdown,
vllm.v1.engine.async_llm.AsyncLLM.shutdown,
vllm.v1.executor.multiproc_executor.WorkerProc.worker_busy_loop; written against vLLM 0.32.

Remove when: vLLM grants the engine core a teardown window on the CPU
(`get_engine_process_shutdown_timeout(0, 0) > 0` there: `apply()` then returns False), its
output handler tells a shutdown from a dead engine, and workers leave terminal SIGINTs to
the engine core.
"""
from __future__ import annotations

import functools
import signal
import time

from vllm_deepinfer.patches.base import PatchUnavailable, parameter_names, source_of

UPSTREAM = ("vllm.v1.engine.utils.CoreEngineProcManager.shutdown, "
            "vllm.v1.engine.async_llm.AsyncLLM.shutdown, "
            "vllm.v1.executor.multiproc_executor.WorkerProc.worker_busy_loop")

_MARK = "_deepinfer_clean_shutdown"
# The executor's wait after the SIGTERM it sends to workers that outlived
# VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, and a margin for the engine core's own teardown.
_EXECUTOR_SIGTERM_WAIT_S = 4.0
_MARGIN_S = 3.0
# How long the final outputs (sent by the engine core before its teardown) may still be
# on their way once it has exited; the wait ends as soon as every request has its own.
# Generous, because a loaded machine can keep the front end's event loop from reading them.
_FINAL_OUTPUTS_WAIT_S = 5.0
# Set on a process manager by AsyncLLM.shutdown: what to do once its engine core exited.
_AFTER_ENGINE_EXIT = "_deepinfer_after_engine_exit"


def teardown_window_s() -> float:
    """Seconds the engine core gets to abort its requests, stop its workers and exit."""
    import vllm.envs as envs

    return envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS + _EXECUTOR_SIGTERM_WAIT_S + _MARGIN_S


def _method(cls, name: str, dotted: str):
    method = cls.__dict__.get(name)
    if not callable(method):
        raise PatchUnavailable(f"{dotted} is missing")
    return method


def _require(source: str, dotted: str, needed: tuple[tuple[str, str], ...]) -> None:
    for text, meaning in needed:
        if text not in source:
            raise PatchUnavailable(f"{dotted} no longer {meaning} (no {text!r} in its source)")


def _check_upstream():
    """(process manager, AsyncLLM, WorkerProc, engine utils module); raises
    PatchUnavailable when a symbol or the behaviour a wrapper relies on has changed."""
    try:
        from vllm.v1.engine import async_llm, core, core_client, output_processor, utils
        from vllm.v1.executor import multiproc_executor
    except ImportError as exc:
        raise PatchUnavailable(f"vLLM's engine modules cannot be imported ({exc})") from exc
    classes = []
    for module, name in ((utils, "CoreEngineProcManager"), (async_llm, "AsyncLLM"),
                         (multiproc_executor, "WorkerProc"), (core, "EngineCoreProc"),
                         (core_client, "MPClient"), (output_processor, "OutputProcessor")):
        cls = getattr(module, name, None)
        if cls is None:
            raise PatchUnavailable(f"{module.__name__}.{name} is missing")
        classes.append(cls)
    (manager_cls, async_llm_cls, worker_cls, engine_core_cls, mp_client_cls,
     output_processor_cls) = classes

    dotted = "vllm.v1.engine.utils.CoreEngineProcManager.shutdown"
    manager_shutdown = _method(manager_cls, "shutdown", dotted)
    if parameter_names(manager_shutdown) != ["self", "timeout"]:
        raise PatchUnavailable(f"{dotted} no longer takes (self, timeout)")
    if not callable(getattr(utils, "get_engine_process_shutdown_timeout", None)):
        raise PatchUnavailable(
            "vllm.v1.engine.utils.get_engine_process_shutdown_timeout is missing")
    _require(source_of(manager_shutdown, dotted), dotted, (
        ("get_engine_process_shutdown_timeout(", "derives the process timeout upstream's way"),
        ("self._request_shutdown_timeout", "keeps the request timeout it derives it from"),
        ("self._finalizer.detach()", "stops the engine core once, through its finalizer")))
    dotted = "vllm.v1.engine.core.EngineCoreProc._handle_shutdown"
    _require(source_of(_method(engine_core_cls, "_handle_shutdown", dotted), dotted), dotted,
             (("_send_abort_outputs(", "aborts in-flight requests on a shutdown request"),))

    dotted = "vllm.v1.engine.async_llm.AsyncLLM.shutdown"
    async_llm_shutdown = _method(async_llm_cls, "shutdown", dotted)
    if parameter_names(async_llm_shutdown) != ["self", "timeout"]:
        raise PatchUnavailable(f"{dotted} no longer takes (self, timeout)")
    _require(source_of(async_llm_shutdown, dotted), dotted, (
        ("engine_core.shutdown(", "stops the engine core client"),
        ("cancel_task_threadsafe(", "cancels the output handler from any thread")))
    _method(output_processor_cls, "propagate_error",
            "vllm.v1.engine.output_processor.OutputProcessor.propagate_error")
    _require(source_of(_method(async_llm_cls, "__init__", "AsyncLLM.__init__"),
                       "AsyncLLM.__init__"), "AsyncLLM.__init__",
             (("self.output_processor = ", "keeps its output processor"),))
    if not callable(getattr(async_llm, "cancel_task_threadsafe", None)):
        raise PatchUnavailable("vllm.v1.engine.async_llm.cancel_task_threadsafe is missing")
    _method(async_llm_cls, "get_num_unfinished_requests",
            "vllm.v1.engine.async_llm.AsyncLLM.get_num_unfinished_requests")
    dotted = "vllm.v1.engine.core_client.MPClient.shutdown"
    _require(source_of(_method(mp_client_cls, "shutdown", dotted), dotted), dotted,
             (("engine_manager.shutdown(", "stops the engine core through its manager"),))

    dotted = "vllm.v1.executor.multiproc_executor.WorkerProc.worker_busy_loop"
    _method(worker_cls, "worker_busy_loop", dotted)
    worker_main = _method(worker_cls, "worker_main",
                          "vllm.v1.executor.multiproc_executor.WorkerProc.worker_main")
    _require(source_of(worker_main, "WorkerProc.worker_main"), "WorkerProc.worker_main", (
        ("signal.SIGINT", "handles SIGINT"),
        ("worker_busy_loop()", "serves in worker_busy_loop"),
        ("monitor_death_pipe(", "stops when the engine core closes its death pipe")))
    return manager_cls, async_llm_cls, worker_cls, utils, async_llm.cancel_task_threadsafe


def _wrap_manager_shutdown(original):
    @functools.wraps(original)
    def shutdown(self, timeout=None):
        stops_engine = self._finalizer.alive  # later calls (e.g. its monitor's) do nothing
        if timeout == 0 and self._request_shutdown_timeout == 0:
            timeout = teardown_window_s()
        try:
            return original(self, timeout)
        finally:
            after_exit = stops_engine and self.__dict__.pop(_AFTER_ENGINE_EXIT, None)
            if after_exit:
                after_exit()

    setattr(shutdown, _MARK, True)
    return shutdown


def _end_output_handler(engine, handler, cancel_task_threadsafe) -> None:
    """Once the engine core has exited, before the client's sockets close: waits briefly
    for every request's final output; fails the requests still without one (the engine
    core had to be killed) with EngineDeadError, as the output handler does for a dead
    engine; then cancels the output handler."""
    from vllm.v1.engine.exceptions import EngineDeadError

    deadline = time.monotonic() + _FINAL_OUTPUTS_WAIT_S
    while engine.get_num_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    loop = handler.get_loop()
    if engine.get_num_unfinished_requests() and not loop.is_closed():
        loop.call_soon_threadsafe(engine.output_processor.propagate_error, EngineDeadError())
    cancel_task_threadsafe(handler)


def _wrap_async_llm_shutdown(original, cancel_task_threadsafe):
    @functools.wraps(original)
    def shutdown(self, timeout=None):
        resources = getattr(getattr(self, "engine_core", None), "resources", None)
        manager = getattr(resources, "engine_manager", None)
        handler = getattr(self, "output_handler", None)
        if manager is not None and handler is not None and not handler.done():
            setattr(manager, _AFTER_ENGINE_EXIT, functools.partial(
                _end_output_handler, self, handler, cancel_task_threadsafe))
        return original(self, timeout)

    setattr(shutdown, _MARK, True)
    return shutdown


def _wrap_worker_busy_loop(original):
    @functools.wraps(original)
    def worker_busy_loop(self, *args, **kwargs):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return original(self, *args, **kwargs)

    setattr(worker_busy_loop, _MARK, True)
    return worker_busy_loop


def apply() -> bool:
    """Idempotent. True when the wrappers are installed; False off the CPU platform or
    where upstream already grants the CPU a teardown window; raises PatchUnavailable when
    vLLM no longer matches."""
    from vllm.platforms import current_platform

    manager_cls, async_llm_cls, worker_cls, utils, cancel_task_threadsafe = _check_upstream()
    if getattr(manager_cls.shutdown, _MARK, False):
        return True
    if not current_platform.is_cpu() or utils.get_engine_process_shutdown_timeout(0, 0) != 0:
        return False
    manager_cls.shutdown = _wrap_manager_shutdown(manager_cls.shutdown)
    async_llm_cls.shutdown = _wrap_async_llm_shutdown(async_llm_cls.shutdown,
                                                      cancel_task_threadsafe)
    worker_cls.worker_busy_loop = _wrap_worker_busy_loop(worker_cls.worker_busy_loop)
    return True
