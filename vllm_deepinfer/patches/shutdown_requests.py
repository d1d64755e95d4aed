"""Every request in flight or arriving while a server stops ends with an error, on the
CPU (docs/patches.md).

- `AsyncLLM.shutdown` marks its client as stopping, keeps the renderer until the engine
  core has stopped (a request being rendered got a 500), and once the engine core has
  exited waits briefly for every request's final output, ends those without one with an
  `abort` output and only then cancels the output handler (upstream's race logged a false
  EngineDeadError or left requests hanging).
- A request added while the client stops ends at once with an `abort` output.
- vLLM's routes answer a shutdown `abort` with its 503 (`RetryableRequestError`) instead
  of a cut answer that looks finished. Skipped where vLLM's routes already fail it."""

from __future__ import annotations

import functools
import inspect
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import NamedTuple

from vllm_deepinfer.patches.base import (
    PatchUnavailable,
    installed,
    left_to_vllm,
    parameter_names,
    require_source,
    upstream_method,
    upstream_symbols,
)

UPSTREAM = (
    "vllm.v1.engine.async_llm.AsyncLLM.shutdown, "
    "vllm.v1.engine.async_llm.AsyncLLM._add_request, "
    "vllm.v1.engine.utils.CoreEngineProcManager.shutdown, "
    "vllm.entrypoints.generate.base.serving.GenerateBaseServing._raise_if_error"
)
_MARK = "_deepinfer_shutdown_requests"
LEFT_TO_VLLM = ""
# How long the final outputs (sent by the engine core before its teardown) may still be
# on their way once it has exited; the wait ends as soon as every request has its own.
_FINAL_OUTPUTS_WAIT_S = 5.0
# Set on a process manager by AsyncLLM.shutdown: what to do once its engine core exited.
_AFTER_ENGINE_EXIT = "_deepinfer_after_engine_exit"
# Set on an AsyncLLM when its shutdown begins.
_SHUTTING_DOWN = "_deepinfer_shutting_down"
# What vLLM's routes answer for a request aborted at shutdown: the DeepSeek routes' words
# (vllm_deepinfer.serving.chat_service.ABORTED).
SHUTDOWN_ABORT = "the engine aborted this request (the server is shutting down); retry it"


def shutting_down(engine_client) -> bool:
    """Whether the server has begun to stop `engine_client` (an AsyncLLM)."""
    return getattr(engine_client, _SHUTTING_DOWN, False)


class _Upstream(NamedTuple):
    async_llm_cls: type
    manager_cls: type
    serving_cls: type
    retryable_error: type
    vllm_error: type
    cancel_task_threadsafe: Callable


def _check_upstream() -> _Upstream:
    try:
        from vllm import exceptions
        from vllm.entrypoints.generate.base import serving
        from vllm.v1.engine import async_llm, core_client, output_processor, utils
    except ImportError as exc:
        raise PatchUnavailable(f"vLLM's engine modules cannot be imported ({exc})") from exc
    *fields, mp_client_cls, output_processor_cls = upstream_symbols(
        (async_llm, "AsyncLLM"),
        (utils, "CoreEngineProcManager"),
        (serving, "GenerateBaseServing"),
        (exceptions, "RetryableRequestError"),
        (exceptions, "VLLMError"),
        (async_llm, "cancel_task_threadsafe"),
        (core_client, "MPClient"),
        (output_processor, "OutputProcessor"),
    )
    upstream = _Upstream(*fields)
    async_llm_cls = upstream.async_llm_cls
    for cls, name, parameters in (
        (async_llm_cls, "shutdown", ["self", "timeout"]),
        (
            async_llm_cls,
            "_add_request",
            ["self", "request", "prompt", "parent_req", "index", "queue"],
        ),
        (upstream.manager_cls, "shutdown", ["self", "timeout"]),
        (upstream.serving_cls, "_raise_if_error", ["self", "finish_reason", "request_id"]),
        (output_processor_cls, "abort_requests", ["self", "request_ids", "internal"]),
    ):
        symbol = f"{cls.__module__}.{cls.__name__}.{name}"
        if parameter_names(upstream_method(cls, name, symbol)) != parameters:
            raise PatchUnavailable(f"{symbol} no longer takes ({', '.join(parameters)})")
    upstream_method(
        async_llm_cls,
        "get_num_unfinished_requests",
        "vllm.v1.engine.async_llm.AsyncLLM.get_num_unfinished_requests",
    )
    if "engine_client" not in parameter_names(upstream.serving_cls.__init__):
        raise PatchUnavailable("GenerateBaseServing.__init__ no longer takes an engine_client")
    # Read from the source: running them would stop a real client's metrics and engine.
    require_source(
        async_llm_cls.shutdown,
        "vllm.v1.engine.async_llm.AsyncLLM.shutdown",
        (
            ("renderer.shutdown()", "shuts its renderer down"),
            ("engine_core.shutdown(", "stops the engine core client"),
        ),
    )
    require_source(
        mp_client_cls.shutdown,
        "vllm.v1.engine.core_client.MPClient.shutdown",
        (("engine_manager.shutdown(", "stops the engine core through its manager"),),
    )
    _probe_add_request(inspect.unwrap(async_llm_cls._add_request))
    if not isinstance(
        getattr(output_processor_cls(None, log_stats=False), "request_states", None), dict
    ):
        raise PatchUnavailable("OutputProcessor no longer keeps its requests in request_states")
    return upstream


def _probe_add_request(add_request) -> None:
    """Upstream's `_add_request` run on a stand-in client: it registers the request with
    the output processor (`self.output_processor`), then sends it to the engine core."""
    events = []

    class Processor:
        def has_request(self, request_id):
            return False

        def add_request(self, *args):
            events.append("registered")

    class Client:
        async def add_request_async(self, request):
            events.append("sent")

    client = SimpleNamespace(
        output_processor=Processor(),
        engine_core=Client(),
        log_requests=False,
        check_admission=lambda *a, **k: None,
    )
    symbol = "vllm.v1.engine.async_llm.AsyncLLM._add_request"
    step = add_request(client, SimpleNamespace(request_id="deepinfer-probe"), None, None, 0, None)
    try:
        step.send(None)
    except StopIteration:
        pass
    except Exception as exc:  # noqa: BLE001 - whatever changed, the probe cannot tell
        raise PatchUnavailable(
            f"{symbol} cannot be probed on a stand-in client ({type(exc).__name__}: {exc})"
        ) from exc
    else:
        step.close()
        raise PatchUnavailable(f"{symbol} now waits for more than the engine core client")
    if events != ["registered", "sent"]:
        raise PatchUnavailable(
            f"{symbol} no longer registers a request with its output "
            f"processor and then sends it to the engine core ({events})"
        )


def upstream_routes_fail_shutdown_aborts(upstream: _Upstream) -> str:
    """The probe: upstream's check of a finished request on its routes, for a request
    aborted while its client stops. Upstream does it when that raises one of its errors."""
    serving = SimpleNamespace(engine_client=SimpleNamespace(**{_SHUTTING_DOWN: True}))
    try:
        upstream.serving_cls._raise_if_error(serving, "abort", "deepinfer-shutdown-probe")
    except upstream.vllm_error as exc:
        return f"answers a request aborted at shutdown with {type(exc).__name__}"
    except Exception as exc:  # noqa: BLE001 - any other failure leaves the question open
        raise PatchUnavailable(
            "GenerateBaseServing._raise_if_error cannot be probed for a "
            f"shutdown abort ({type(exc).__name__}: {exc})"
        ) from exc
    return ""


def _wrap_manager_shutdown(original):
    """Runs the step AsyncLLM.shutdown left on the manager once the call that stopped the
    engine core has returned (before the client closes its sockets)."""

    @functools.wraps(original)
    def shutdown(self, timeout=None):
        stops_engine = self._finalizer.alive  # later calls (e.g. its monitor's) do nothing
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
    """Once the engine core has exited: waits briefly for every request's final output,
    ends those still without one with an `abort` output, then cancels the handler."""
    deadline = time.monotonic() + _FINAL_OUTPUTS_WAIT_S
    while engine.get_num_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    loop = handler.get_loop()
    if engine.get_num_unfinished_requests() and not loop.is_closed():
        loop.call_soon_threadsafe(_abort_unfinished, engine.output_processor)
    cancel_task_threadsafe(handler)


def _later() -> None:
    """The renderer's shutdown while the engine core stops (the wrapper below calls the
    real one afterwards)."""


def _wrap_async_llm_shutdown(original, cancel_task_threadsafe):
    @functools.wraps(original)
    def shutdown(self, timeout=None):
        setattr(self, _SHUTTING_DOWN, True)
        resources = getattr(getattr(self, "engine_core", None), "resources", None)
        manager = getattr(resources, "engine_manager", None)
        handler = getattr(self, "output_handler", None)
        if manager is not None and handler is not None and not handler.done():
            setattr(
                manager,
                _AFTER_ENGINE_EXIT,
                functools.partial(_end_output_handler, self, handler, cancel_task_threadsafe),
            )
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


def _wrap_raise_if_error(original, retryable_error):
    @functools.wraps(original)
    def raise_if_error(self, finish_reason, request_id):
        if finish_reason == "abort" and shutting_down(self.engine_client):
            raise retryable_error(SHUTDOWN_ABORT)
        return original(self, finish_reason, request_id)

    setattr(raise_if_error, _MARK, True)
    return raise_if_error


def apply() -> bool:
    """Idempotent; True once installed, False off the CPU or where vLLM's routes already
    answer a shutdown abort with an error."""
    from vllm.platforms import current_platform

    global LEFT_TO_VLLM
    upstream = _check_upstream()
    if not current_platform.is_cpu():
        return False
    async_llm_cls = upstream.async_llm_cls
    if installed(async_llm_cls.shutdown, _MARK):
        return True
    does = upstream_routes_fail_shutdown_aborts(upstream)
    if does:
        return left_to_vllm(sys.modules[__name__], does)
    LEFT_TO_VLLM = ""
    async_llm_cls.shutdown = _wrap_async_llm_shutdown(
        async_llm_cls.shutdown, upstream.cancel_task_threadsafe
    )
    async_llm_cls._add_request = _wrap_add_request(async_llm_cls._add_request)
    upstream.manager_cls.shutdown = _wrap_manager_shutdown(upstream.manager_cls.shutdown)
    upstream.serving_cls._raise_if_error = _wrap_raise_if_error(
        upstream.serving_cls._raise_if_error, upstream.retryable_error
    )
    return True
