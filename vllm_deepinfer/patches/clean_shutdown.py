"""A clean `vllm serve` shutdown on SIGTERM and SIGINT on the CPU, at any moment and on a
loaded machine.

Why: on either signal the API server stops the engine client with the request timeout
(`--shutdown-timeout`, default 0: "abort" mode), and these things go wrong on the CPU:
- `CoreEngineProcManager.shutdown(timeout=0)` sends the engine core SIGTERM and, with no
  time left, force-kills it and its workers at once (upstream grants a teardown window
  after the abort on ROCm only, `get_engine_process_shutdown_timeout`; vLLM 0.33 also where
  VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS is set, a window that long). The engine core
  never aborts its in-flight requests, so their HTTP connections hang, and its and its
  workers' shared-memory queues and semaphores are left to the resource tracker
  ("leaked shared_memory" / "leaked semaphore" warnings).
- Even with a window, a worker and then its engine core each spend seconds of CPU in the
  interpreter's final cyclic-GC scan of their heap (`gc.unfreeze()` in their teardown
  gives it all vLLM's start-up objects): on a loaded machine the worker outlived the
  executor's 5 s grace and the engine core the 12 s window, and was force-killed. The API
  server's own exit spends seconds there too. And the step under way when the signal
  lands, which the engine core finishes first, took 6 s.
- Once the engine core has exited, `AsyncLLM.shutdown` closes the client's sockets and
  cancels its output handler as two separate callbacks on the event loop; when the loop
  runs between them, the handler receives the EngineDeadError the closed output queue
  leaves behind and logs "AsyncLLM output_handler failed" with a traceback, on a clean
  stop. Upstream's race can also cancel the handler before it sees the dead engine, and
  a request the engine core never took (sent as it stopped) has no output to wait for:
  those requests hang.
- `AsyncLLM.shutdown` shuts the renderer down first: a request being rendered then (an
  image being processed, a prompt tokenized) fails with RuntimeError, a 500 and a
  traceback.
- Ctrl-C sends SIGINT to the whole process group. The worker's handler raises SystemExit
  wherever it is, also in the middle of a model step, so the engine core, which got the
  same SIGINT and was about to abort its requests, finds its worker dead, dies with a
  fatal error and fails every in-flight request with EngineDeadError. The engine core
  itself starts its abort on that SIGINT, before the API server knows it is stopping.
- vLLM's own routes (`/v1/completions`, and every generation route of a model the
  DeepSeek front end does not serve) answer a request the engine aborted at shutdown as a
  finished one, with finish reason `abort` and the text so far (a 200, or a stream ending
  normally): the `openai` SDK raises nothing, and the client holds a cut answer.

How (on the CPU platform only), in three parts, each installed unless a probe of the
installed vLLM finds upstream already does what it restores (`PARTS` records which are
active and which are fixed upstream; the others are installed all the same):
- the process teardown and signals (the SIGTERM-deaf teardown, the exit's heap freeze,
  SIGINT and a group SIGTERM left to the API server, the workers' exit grace);
- the teardown window (kept wherever upstream's abort-mode process timeout is shorter);
- the request endings at shutdown (AsyncLLM.shutdown, requests added while it runs, the
  503 on vLLM's routes).

The fixes:
- A zero process timeout in abort mode becomes a teardown window: the engine core aborts
  every in-flight request at once (each ends with finish reason `abort`, which the front
  ends answer with an error), stops its workers and exits; the process manager waits up
  to the window (returning as soon as the engine core has exited) and force-kills only
  past it. The window is the model step under way (10 s), what the engine core's executor
  may itself take to stop its workers (`VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`, which the
  patch defaults to 15 s on the CPU instead of vLLM's 5, then SIGTERM and up to 4 s more)
  and 5 s for the engine core's exit: 34 s. A user's `--shutdown-timeout` (drain mode) is
  left as it is.
- In abort mode every path that stops the engine cores (the API server's signal handler,
  the client's clean-up, its finalizer) waits up to that window, not upstream's 5 or 15 s.
- An engine core's teardown after its busy loop ignores SIGTERM. Upstream restores the
  default action first: after a SIGTERM to the whole process group, the one its process
  manager sends next killed the engine core in the middle of stopping its workers.
- Workers, engine cores and the API server (once it stops its engine client) freeze
  their heap at exit (`gc.freeze()` from `atexit`, as upstream's engine core does on
  ROCm): the final scan skips it, and the OS reclaims it.
- `AsyncLLM.shutdown` marks the engine client as shutting down; keeps the renderer until
  the engine core has stopped; and asks the process manager, once the engine core has
  exited and before the client goes on to close its sockets, to wait briefly until every
  request has received its final output, to end those still without one with an `abort`
  output, as if the engine core had aborted them, and then to cancel the output handler.
  A request added while the client shuts down is not sent to the engine core: it gets its
  `abort` output at once.
- Workers and engine cores ignore SIGINT once they serve: the API server, which receives
  the same terminal SIGINT, stops the engine cores through their process manager
  (SIGTERM), and each engine core stops its workers through its executor (the death
  pipe), after its own abort; a Ctrl-C thus stops the server in the order SIGTERM does.
  A worker also leaves to its engine core a SIGTERM that reached the whole process group
  (`kill -TERM -PGID`, systemd's default KillMode): ended mid-step (a DP dummy batch), it
  made its engine core fail with a fatal error. SIGTERM once the executor is stopping the
  worker (its escalation) or once the engine core is gone keeps upstream's handling.
- On vLLM's routes, a request that ends with finish reason `abort` while its engine
  client is shutting down raises `RetryableRequestError` (vLLM's 503, "retry it") with the
  DeepSeek routes' words, which those routes turn into an error response or a stream's
  error event; an `abort` at any other time (e.g. `/pause?mode=abort`) is left as it is.

Upstream symbols: vllm.v1.engine.utils.CoreEngineProcManager.shutdown,
vllm.v1.engine.async_llm.AsyncLLM.shutdown and _add_request,
vllm.v1.executor.multiproc_executor.WorkerProc.worker_busy_loop,
vllm.v1.engine.core.EngineCoreProc.run_busy_loop (and DPEngineCoreProc's),
vllm.v1.engine.core.EngineCore.shutdown and DPEngineCoreProc.shutdown,
vllm.entrypoints.generate.base.serving.GenerateBaseServing._raise_if_error; written against
vLLM 0.32.

Remove when: vLLM grants the engine core a teardown window on the CPU as long as the
patch's (`get_engine_process_shutdown_timeout(0, 0) >= teardown_window_s()` there; that
part is then reported fixed upstream, and `apply()` returns False once all three are),
its processes skip the exit scan there too, its output handler tells a shutdown from a dead
engine and ends every request at shutdown, its renderer outlives the engine core, its
workers and engine cores leave terminal SIGINTs to the API server, and its routes answer
a shutdown abort with an error.
"""
from __future__ import annotations

import atexit
import functools
import gc
import os
import signal
import threading
import time
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Callable, NamedTuple

from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.patches.base import PatchUnavailable, parameter_names, source_of

logger = init_logger(__name__)

UPSTREAM = ("vllm.v1.engine.utils.CoreEngineProcManager.shutdown, "
            "vllm.v1.engine.async_llm.AsyncLLM.shutdown, "
            "vllm.v1.engine.async_llm.AsyncLLM._add_request, "
            "vllm.v1.executor.multiproc_executor.WorkerProc.worker_busy_loop, "
            "vllm.v1.engine.core.EngineCoreProc.run_busy_loop, "
            "vllm.v1.engine.core.DPEngineCoreProc.run_busy_loop, "
            "vllm.v1.engine.core.EngineCore.shutdown, "
            "vllm.v1.engine.core.DPEngineCoreProc.shutdown, "
            "vllm.entrypoints.generate.base.serving.GenerateBaseServing._raise_if_error")

_MARK = "_deepinfer_clean_shutdown"
# The executor's wait after the SIGTERM it sends to workers that outlived
# VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (it kills them then).
_EXECUTOR_SIGTERM_WAIT_S = 4.0
# The model step under way when the signal lands, which the engine core finishes before it
# aborts (6 s measured on a loaded 2-core machine), and then the engine core's own exit.
_STEP_S = 10.0
_MARGIN_S = 5.0
# The executor's grace for its workers' exit on the CPU, where the user has set none
# (vLLM: 5 s): on a loaded machine a worker took longer, and was killed past 9 s.
WORKER_EXIT_GRACE_S = 15
# How long the final outputs (sent by the engine core before its teardown) may still be
# on their way once it has exited; the wait ends as soon as every request has its own.
# Generous, because a loaded machine can keep the front end's event loop from reading them.
_FINAL_OUTPUTS_WAIT_S = 5.0
# Set on a process manager by AsyncLLM.shutdown: what to do once its engine core exited.
_AFTER_ENGINE_EXIT = "_deepinfer_after_engine_exit"
# Set on an AsyncLLM when its shutdown begins.
_SHUTTING_DOWN = "_deepinfer_shutting_down"
# Set on an engine core process when its teardown begins.
_TEARING_DOWN = "_deepinfer_tearing_down"
# What vLLM's routes answer for a request aborted at shutdown: the DeepSeek routes' words
# (vllm_deepinfer.serving.chat_service.ABORTED).
SHUTDOWN_ABORT = "the engine aborted this request (the server is shutting down); retry it"


def teardown_window_s() -> float:
    """Seconds the engine core gets to abort its requests, stop its workers and exit."""
    import vllm.envs as envs

    return (_STEP_S + envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS + _EXECUTOR_SIGTERM_WAIT_S
            + _MARGIN_S)


def shutting_down(engine_client) -> bool:
    """Whether the server has begun to stop `engine_client` (an AsyncLLM)."""
    return getattr(engine_client, _SHUTTING_DOWN, False)


def _method(cls, name: str, dotted: str):
    method = cls.__dict__.get(name)
    if not callable(method):
        raise PatchUnavailable(f"{dotted} is missing")
    return method


def _require(source: str, dotted: str, needed: tuple[tuple[str, str], ...]) -> None:
    for text, meaning in needed:
        if text not in source:
            raise PatchUnavailable(f"{dotted} no longer {meaning} (no {text!r} in its source)")


class _Upstream(NamedTuple):
    """What the wrappers go on and the probes call, as `_check_upstream` found it."""
    manager_cls: type
    async_llm_cls: type
    worker_cls: type
    engine_core_classes: tuple[type, type]  # EngineCoreProc, DPEngineCoreProc
    serving_cls: type
    retryable_error: type
    vllm_error: type
    utils: ModuleType  # vllm.v1.engine.utils
    cancel_task_threadsafe: Callable


def _check_upstream() -> _Upstream:
    """The classes the wrappers go on (process manager, AsyncLLM, WorkerProc, the two
    engine core processes, vLLM's generation serving base), vLLM's retryable request
    error and its `cancel_task_threadsafe`; raises PatchUnavailable when a symbol or the
    behaviour a wrapper relies on has changed."""
    try:
        from vllm import exceptions
        from vllm.entrypoints.generate.base import serving
        from vllm.v1.engine import async_llm, core, core_client, output_processor, utils
        from vllm.v1.executor import multiproc_executor
    except ImportError as exc:
        raise PatchUnavailable(f"vLLM's engine modules cannot be imported ({exc})") from exc
    classes = []
    for module, name in ((utils, "CoreEngineProcManager"), (async_llm, "AsyncLLM"),
                         (multiproc_executor, "WorkerProc"), (core, "EngineCoreProc"),
                         (core, "DPEngineCoreProc"), (serving, "GenerateBaseServing"),
                         (core_client, "MPClient"), (output_processor, "OutputProcessor"),
                         (exceptions, "RetryableRequestError")):
        cls = getattr(module, name, None)
        if cls is None:
            raise PatchUnavailable(f"{module.__name__}.{name} is missing")
        classes.append(cls)
    (manager_cls, async_llm_cls, worker_cls, engine_core_cls, dp_engine_core_cls,
     serving_cls, mp_client_cls, output_processor_cls, retryable_error) = classes

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
    for cls in (engine_core_cls, dp_engine_core_cls):
        _method(cls, "run_busy_loop", f"vllm.v1.engine.core.{cls.__name__}.run_busy_loop")
    dotted = "vllm.v1.engine.core.EngineCoreProc.run_engine_core"
    _require(source_of(_method(engine_core_cls, "run_engine_core", dotted), dotted), dotted,
             (("engine_core.shutdown()", "tears its engine core down after the busy loop"),))
    base_engine_core = getattr(core, "EngineCore", None)
    if base_engine_core is None:
        raise PatchUnavailable("vllm.v1.engine.core.EngineCore is missing")
    _method(base_engine_core, "shutdown", "vllm.v1.engine.core.EngineCore.shutdown")
    _method(dp_engine_core_cls, "shutdown", "vllm.v1.engine.core.DPEngineCoreProc.shutdown")

    dotted = "vllm.v1.engine.async_llm.AsyncLLM.shutdown"
    async_llm_shutdown = _method(async_llm_cls, "shutdown", dotted)
    if parameter_names(async_llm_shutdown) != ["self", "timeout"]:
        raise PatchUnavailable(f"{dotted} no longer takes (self, timeout)")
    _require(source_of(async_llm_shutdown, dotted), dotted, (
        ("renderer.shutdown()", "shuts its renderer down"),
        ("engine_core.shutdown(", "stops the engine core client"),
        ("cancel_task_threadsafe(", "cancels the output handler from any thread")))
    dotted = "vllm.v1.engine.async_llm.AsyncLLM._add_request"
    add_request = _method(async_llm_cls, "_add_request", dotted)
    if parameter_names(add_request) != ["self", "request", "prompt", "parent_req", "index",
                                        "queue"]:
        raise PatchUnavailable(f"{dotted} no longer takes (self, request, prompt, parent_req, "
                               "index, queue)")
    _require(source_of(add_request, dotted), dotted, (
        ("self.output_processor.add_request(", "registers the request with its processor"),
        ("add_request_async(", "sends the request to the engine core")))
    dotted = "vllm.v1.engine.output_processor.OutputProcessor.abort_requests"
    if parameter_names(_method(output_processor_cls, "abort_requests", dotted)) != [
            "self", "request_ids", "internal"]:
        raise PatchUnavailable(f"{dotted} no longer takes (self, request_ids, internal)")
    _require(source_of(_method(output_processor_cls, "__init__", "OutputProcessor.__init__"),
                       "OutputProcessor.__init__"), "OutputProcessor.__init__",
             (("self.request_states", "keeps its requests' states"),))
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
        ("worker_busy_loop()", "serves in worker_busy_loop"),
        ("monitor_death_pipe(", "stops when the engine core closes its death pipe")))

    dotted = "vllm.entrypoints.generate.base.serving.GenerateBaseServing._raise_if_error"
    raise_if_error = _method(serving_cls, "_raise_if_error", dotted)
    if parameter_names(raise_if_error) != ["self", "finish_reason", "request_id"]:
        raise PatchUnavailable(f"{dotted} no longer takes (self, finish_reason, request_id)")
    _require(source_of(_method(serving_cls, "__init__", "GenerateBaseServing.__init__"),
                       "GenerateBaseServing.__init__"), "GenerateBaseServing.__init__",
             (("self.engine_client = ", "keeps its engine client"),))
    return _Upstream(manager_cls, async_llm_cls, worker_cls,
                     (engine_core_cls, dp_engine_core_cls), serving_cls, retryable_error,
                     exceptions.VLLMError, utils, async_llm.cancel_task_threadsafe)


def _wrap_manager_shutdown(original):
    @functools.wraps(original)
    def shutdown(self, timeout=None):
        stops_engine = self._finalizer.alive  # later calls (e.g. its monitor's) do nothing
        if self._request_shutdown_timeout == 0:
            # Abort mode: whichever path stops the engine core first (the API server's
            # signal handler with 0, the client's clean-up or finalizer with upstream's
            # 5 or 15 s), it gets the whole window, and the wait ends when it has exited.
            timeout = max(timeout or 0, teardown_window_s())
        try:
            return original(self, timeout)
        finally:
            after_exit = stops_engine and self.__dict__.pop(_AFTER_ENGINE_EXIT, None)
            if after_exit:
                after_exit()

    setattr(shutdown, _MARK, True)
    return shutdown


def _abort_unfinished(output_processor) -> None:
    """Ends every request still unfinished with a final `abort` output, as the engine core
    ends those it aborts (on the event loop: the output processor is not thread-safe)."""
    output_processor.abort_requests(list(output_processor.request_states), internal=True)


def _end_output_handler(engine, handler, cancel_task_threadsafe) -> None:
    """Once the engine core has exited, before the client's sockets close: waits briefly
    for every request's final output; ends the requests still without one (the engine
    core never took them, or had to be killed) with an `abort` output, as if the engine
    core had aborted them; then cancels the output handler."""
    deadline = time.monotonic() + _FINAL_OUTPUTS_WAIT_S
    while engine.get_num_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    loop = handler.get_loop()
    if engine.get_num_unfinished_requests() and not loop.is_closed():
        loop.call_soon_threadsafe(_abort_unfinished, engine.output_processor)
    cancel_task_threadsafe(handler)


def _wrap_async_llm_shutdown(original, cancel_task_threadsafe):
    @functools.wraps(original)
    def shutdown(self, timeout=None):
        setattr(self, _SHUTTING_DOWN, True)
        atexit.register(gc.freeze)
        resources = getattr(getattr(self, "engine_core", None), "resources", None)
        manager = getattr(resources, "engine_manager", None)
        handler = getattr(self, "output_handler", None)
        if manager is not None and handler is not None and not handler.done():
            setattr(manager, _AFTER_ENGINE_EXIT, functools.partial(
                _end_output_handler, self, handler, cancel_task_threadsafe))
        # Upstream shuts the renderer down first: a request being rendered then (an image
        # being processed, a prompt tokenized) would fail with RuntimeError, a 500 and a
        # traceback. It renders on until the engine core has stopped, and is then aborted.
        renderer = getattr(self, "renderer", None)
        if renderer is not None:
            renderer.shutdown = _later
        try:
            return original(self, timeout)
        finally:
            if renderer is not None:
                del renderer.shutdown
                renderer.shutdown()

    setattr(shutdown, _MARK, True)
    return shutdown


def _later() -> None:
    """The renderer's shutdown while the engine core stops (AsyncLLM.shutdown's wrapper
    calls the real one afterwards)."""


def _wrap_add_request(original):
    @functools.wraps(original)
    async def add_request(self, request, prompt, parent_req, index, queue):
        if not shutting_down(self):
            return await original(self, request, prompt, parent_req, index, queue)
        # Nothing will run it: it ends at once, as the engine core ends those it aborts.
        self.output_processor.add_request(request, prompt, parent_req, index, queue)
        self.output_processor.abort_requests([request.request_id], internal=True)
        return None

    setattr(add_request, _MARK, True)
    return add_request


def _wrap_engine_core_teardown(original):
    """An engine core process's teardown after its busy loop, deaf to SIGTERM until it
    ends. Upstream restores the default SIGTERM action just before it: when a SIGTERM to
    the whole process group had already reached the engine core, the one its process
    manager sends next killed it in the middle of stopping its workers (they were left to
    their death pipes, its shared memory to the resource tracker). Its process manager
    still kills it once the teardown window has passed."""
    @functools.wraps(original)
    def shutdown(self, *args, **kwargs):
        if (getattr(self, _TEARING_DOWN, False)
                or threading.current_thread() is not threading.main_thread()):
            return original(self, *args, **kwargs)  # nested (the DP engine core's) or not ours
        setattr(self, _TEARING_DOWN, True)
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            return original(self, *args, **kwargs)
        finally:
            signal.signal(signal.SIGTERM, previous)

    setattr(shutdown, _MARK, True)
    return shutdown


def _wrap_busy_loop(original):
    """A worker's or an engine core's serving loop: deaf to SIGINT, and the process leaves
    its heap to the OS when it exits."""
    @functools.wraps(original)
    def busy_loop(self, *args, **kwargs):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        atexit.register(gc.freeze)
        return original(self, *args, **kwargs)

    setattr(busy_loop, _MARK, True)
    return busy_loop


def _wrap_worker_busy_loop(original):
    """A worker's serving loop, as `_wrap_busy_loop`, and deaf to a SIGTERM its engine core
    also received (one to the whole process group: `kill -TERM -PGID`, systemd's default
    KillMode): upstream's handler would end the worker in the middle of a step, and the
    engine core, which is about to abort its requests and stop its workers itself, would
    find it dead and fail with a fatal error. A SIGTERM once the executor is stopping the
    worker (its escalation), or once the engine core is gone, ends it as upstream does."""
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


def _wrap_raise_if_error(original, retryable_error):
    @functools.wraps(original)
    def raise_if_error(self, finish_reason, request_id):
        if finish_reason == "abort" and shutting_down(self.engine_client):
            raise retryable_error(SHUTDOWN_ABORT)
        return original(self, finish_reason, request_id)

    setattr(raise_if_error, _MARK, True)
    return raise_if_error


# --- the three fixes ----------------------------------------------------------------------

ACTIVE, FIXED_UPSTREAM = "active", "fixed upstream"
# This process's state of each part, for the patch report and the logs: ACTIVE, or
# FIXED_UPSTREAM and what upstream does instead.
PARTS: dict[str, str] = {}


@dataclass(frozen=True)
class _Part:
    """One fix: installed unless upstream already does what it restores."""
    name: str
    restores: str
    wrapper: Callable[[_Upstream], object]  # the method whose mark shows it installed
    upstream_does_it: Callable[[_Upstream], str]  # the probe: what upstream does, or ""
    install: Callable[[_Upstream], None]


def _upstream_processes_stop_in_order(upstream: _Upstream) -> str:
    """Read from the source: these behaviours show only in running processes. Upstream
    does it when its workers and engine cores no longer handle SIGINT, its engine core's
    teardown no longer resets SIGTERM to the default action, and its engine core freezes
    its heap at exit on every platform."""
    engine_core_cls = upstream.engine_core_classes[0]
    engine_core_main = source_of(engine_core_cls.__dict__["run_engine_core"],
                                 "EngineCoreProc.run_engine_core")
    worker_main = source_of(upstream.worker_cls.__dict__["worker_main"],
                            "WorkerProc.worker_main")
    if ("signal.SIGINT" in worker_main or "signal.SIGINT" in engine_core_main
            or "signal.SIG_DFL" in engine_core_main or "gc.freeze()" not in engine_core_main
            or "is_rocm()" in engine_core_main):
        return ""
    return ("its workers and engine cores leave SIGINT to the API server, its engine core "
            "keeps its SIGTERM handler through its teardown and freezes its heap at exit")


def _install_processes(upstream: _Upstream) -> None:
    # Inherited by the engine cores, whose executors read it when they stop their workers.
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(WORKER_EXIT_GRACE_S))
    upstream.worker_cls.worker_busy_loop = _wrap_worker_busy_loop(
        upstream.worker_cls.worker_busy_loop)
    engine_core_cls = upstream.engine_core_classes[0]
    for cls in upstream.engine_core_classes:
        cls.run_busy_loop = _wrap_busy_loop(cls.__dict__["run_busy_loop"])
        # EngineCoreProc inherits EngineCore's teardown; DPEngineCoreProc extends it.
        cls.shutdown = _wrap_engine_core_teardown(
            cls.__dict__.get("shutdown", engine_core_cls.shutdown))


def _upstream_window_covers_ours(upstream: _Upstream) -> str:
    """Upstream's process timeout in abort mode, called as its process manager calls it.
    vLLM 0.33 returns VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS there whenever it is set (by the
    user, or by this patch's default, inherited by the engine cores): the workers' grace
    alone, shorter than the patch's window, which adds the step under way, the executor's
    SIGTERM wait and the engine core's exit; the patch keeps its own."""
    upstream_window = upstream.utils.get_engine_process_shutdown_timeout(0, 0) or 0
    window = teardown_window_s()
    if upstream_window < window:
        return ""
    return (f"it grants the engine core {upstream_window:g} s after the abort (the patch's "
            f"window: {window:g} s)")


def _install_window(upstream: _Upstream) -> None:
    upstream.manager_cls.shutdown = _wrap_manager_shutdown(upstream.manager_cls.shutdown)


def _upstream_routes_fail_shutdown_aborts(upstream: _Upstream) -> str:
    """Upstream's check of a finished request on its routes, called for a request aborted
    while its engine client shuts down: it does it when that raises one of vLLM's errors
    (an error response) instead of passing the cut answer on."""
    serving = SimpleNamespace(engine_client=SimpleNamespace(**{_SHUTTING_DOWN: True}))
    try:
        upstream.serving_cls._raise_if_error(serving, "abort", "deepinfer-shutdown-probe")
    except upstream.vllm_error as exc:
        return f"its routes answer a request aborted at shutdown with {type(exc).__name__}"
    except Exception as exc:  # noqa: BLE001 - any other failure leaves the question open
        raise PatchUnavailable("GenerateBaseServing._raise_if_error cannot be probed for a "
                               f"shutdown abort ({type(exc).__name__}: {exc})") from exc
    return ""


def _install_front_end(upstream: _Upstream) -> None:
    async_llm_cls = upstream.async_llm_cls
    async_llm_cls.shutdown = _wrap_async_llm_shutdown(async_llm_cls.shutdown,
                                                      upstream.cancel_task_threadsafe)
    async_llm_cls._add_request = _wrap_add_request(async_llm_cls._add_request)
    upstream.serving_cls._raise_if_error = _wrap_raise_if_error(
        upstream.serving_cls._raise_if_error, upstream.retryable_error)


PROCESSES, WINDOW, FRONT_END = ("process teardown and signals", "teardown window",
                                "request endings at shutdown")
# The processes' part first: the window counts the workers' exit grace it sets.
_PARTS = (
    _Part(PROCESSES,
          "workers and engine cores leave a terminal's SIGINT and a process group's SIGTERM "
          "to the API server's stop, finish their teardown whatever SIGTERM follows (a "
          "worker given 15 s), and skip the exit's GC scan",
          lambda upstream: upstream.worker_cls.worker_busy_loop,
          _upstream_processes_stop_in_order, _install_processes),
    _Part(WINDOW,
          "in abort mode the engine core gets the teardown window to abort its requests, "
          "stop its workers and exit before its process manager kills it",
          lambda upstream: upstream.manager_cls.shutdown,
          _upstream_window_covers_ours, _install_window),
    _Part(FRONT_END,
          "every request in flight or arriving while the server stops ends with vLLM's 503 "
          "(none hangs, is rendered into a 500 or answered as a cut but finished answer), "
          "and the output handler logs no false EngineDeadError",
          lambda upstream: upstream.async_llm_cls.shutdown,
          _upstream_routes_fail_shutdown_aborts, _install_front_end),
)


def apply() -> bool:
    """Idempotent. Installs each part upstream does not already do and records in `PARTS`
    which are active and which upstream fixed; True when any part is active, False off the
    CPU platform or where upstream does all three; raises PatchUnavailable when vLLM no
    longer matches."""
    from vllm.platforms import current_platform

    upstream = _check_upstream()
    if not current_platform.is_cpu():
        return False
    for part in _PARTS:
        if not getattr(part.wrapper(upstream), _MARK, False):
            upstream_does = part.upstream_does_it(upstream)
            if upstream_does:
                state = f"{FIXED_UPSTREAM}: {upstream_does}"
                if PARTS.get(part.name) != state:  # once per process (register() runs often)
                    logger.info("clean_shutdown: its %s part (%s) is left to vLLM: %s",
                                part.name, part.restores, upstream_does)
                PARTS[part.name] = state
                continue
            part.install(upstream)
        PARTS[part.name] = ACTIVE
    return ACTIVE in PARTS.values()
