"""The shutdown_requests patch: its guard and probes on the installed vLLM, and its wrappers
on stand-ins. The server-level behaviour is tests/serving/test_shutdown.py."""

import pytest
from shutdown_parts import EngineProcManagerStandIn, installed

from vllm_deepinfer.patches import shutdown_processes, shutdown_requests, shutdown_window
from vllm_deepinfer.patches.base import PatchUnavailable

pytestmark = pytest.mark.unit


def test_applies_on_this_vllm_and_is_idempotent(shutdown_upstream):
    from vllm.v1.engine.async_llm import AsyncLLM

    assert (
        shutdown_requests.upstream_routes_fail_shutdown_aborts(shutdown_requests._check_upstream())
        == ""
    )
    assert shutdown_requests.apply()
    assert installed(shutdown_upstream, shutdown_requests)
    assert shutdown_requests.LEFT_TO_VLLM == ""
    wrapper = AsyncLLM.shutdown
    assert shutdown_requests.apply()
    assert AsyncLLM.shutdown is wrapper


def _raise_if_error_failing_aborts(self, finish_reason, request_id):
    from vllm.exceptions import RetryableRequestError

    if finish_reason in ("abort", "error"):
        raise RetryableRequestError("aborted")


def test_left_to_upstream_where_its_routes_fail_a_shutdown_abort(shutdown_upstream, monkeypatch):
    """Where upstream's routes answer a shutdown abort with an error, the patch is reported
    not needed and the other shutdown patches apply all the same."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing

    monkeypatch.setattr(GenerateBaseServing, "_raise_if_error", _raise_if_error_failing_aborts)
    assert shutdown_requests.apply() is False
    assert not installed(shutdown_upstream, shutdown_requests)
    assert shutdown_requests.LEFT_TO_VLLM == (
        "answers a request aborted at shutdown with RetryableRequestError"
    )
    assert shutdown_processes.apply() and shutdown_window.apply()
    assert installed(shutdown_upstream, shutdown_processes)
    assert installed(shutdown_upstream, shutdown_window)


def _async_llm_shutdown_renamed(self, deadline=None):
    pass


def _async_llm_shutdown_keeping_its_renderer(self, timeout=None):
    self.engine_core.shutdown(timeout=timeout)


async def _add_request_not_sending(self, request, prompt, parent_req, index, queue):
    self.output_processor.add_request(request, prompt, parent_req, index, queue)


async def _add_request_sending_first(self, request, prompt, parent_req, index, queue):
    await self.engine_core.add_request_async(request)
    self.output_processor.add_request(request, prompt, parent_req, index, queue)


async def _add_request_waiting_elsewhere(self, request, prompt, parent_req, index, queue):
    import asyncio

    self.output_processor.add_request(request, prompt, parent_req, index, queue)
    await asyncio.sleep(0)
    await self.engine_core.add_request_async(request)


async def _add_request_with_a_new_step(self, request, prompt, parent_req, index, queue):
    self.validate(request)


def _client_shutdown_closing_first(self, timeout=None):
    self.resources()


def _raise_if_error_renamed(self, finish_reason, request_id, extra=None):
    pass


@pytest.mark.parametrize(
    "module,cls,name,replacement,reason",
    [
        (
            "vllm.v1.engine.async_llm",
            "AsyncLLM",
            "shutdown",
            _async_llm_shutdown_renamed,
            r"AsyncLLM.shutdown no longer takes \(self, timeout\)",
        ),
        (
            "vllm.v1.engine.async_llm",
            "AsyncLLM",
            "shutdown",
            _async_llm_shutdown_keeping_its_renderer,
            "no longer shuts its renderer down",
        ),
        (
            "vllm.v1.engine.async_llm",
            "AsyncLLM",
            "_add_request",
            _add_request_not_sending,
            r"no longer registers a request with its output processor and then sends it",
        ),
        (
            "vllm.v1.engine.async_llm",
            "AsyncLLM",
            "_add_request",
            _add_request_sending_first,
            r"no longer registers a request .* \(\['sent', 'registered'\]\)",
        ),
        (
            "vllm.v1.engine.async_llm",
            "AsyncLLM",
            "_add_request",
            _add_request_waiting_elsewhere,
            "now waits for more than the engine core client",
        ),
        (
            "vllm.v1.engine.async_llm",
            "AsyncLLM",
            "_add_request",
            _add_request_with_a_new_step,
            "cannot be probed on a stand-in client .AttributeError",
        ),
        (
            "vllm.v1.engine.core_client",
            "MPClient",
            "shutdown",
            _client_shutdown_closing_first,
            "no longer stops the engine core through its manager",
        ),
        (
            "vllm.entrypoints.generate.base.serving",
            "GenerateBaseServing",
            "_raise_if_error",
            _raise_if_error_renamed,
            "no longer takes",
        ),
    ],
)
def test_unavailable_when_upstream_changes(
    module, cls, name, replacement, reason, shutdown_upstream, monkeypatch
):
    import importlib

    monkeypatch.setattr(getattr(importlib.import_module(module), cls), name, replacement)
    with pytest.raises(PatchUnavailable, match=reason):
        shutdown_requests.apply()
    assert not installed(shutdown_upstream, shutdown_requests)


def test_unavailable_when_the_output_processor_keeps_its_requests_elsewhere(
    shutdown_upstream, monkeypatch
):
    from vllm.v1.engine.output_processor import OutputProcessor

    original = OutputProcessor.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.states = self.__dict__.pop("request_states")

    monkeypatch.setattr(OutputProcessor, "__init__", __init__)
    with pytest.raises(PatchUnavailable, match="no longer keeps its requests in request_states"):
        shutdown_requests.apply()
    assert not installed(shutdown_upstream, shutdown_requests)


# --- the wrappers -------------------------------------------------------------------------


def test_after_exit_runs_once_in_the_call_that_stopped_the_engine():
    """With the window's wrapper under it, as register() installs them: the step runs once
    the engine core has been given its window and has stopped."""
    manager, ran = EngineProcManagerStandIn(0), []
    shutdown = shutdown_requests._wrap_manager_shutdown(
        shutdown_window._wrap_manager_shutdown(EngineProcManagerStandIn.shutdown)
    )
    setattr(manager, shutdown_requests._AFTER_ENGINE_EXIT, lambda: ran.append(manager.timeouts[:]))
    shutdown(manager, 0)
    assert ran == [[shutdown_window.teardown_window_s()]]  # after the engine core stopped
    shutdown(manager, None)  # e.g. its liveness monitor, once it saw the manager stop
    assert len(ran) == 1

    late = EngineProcManagerStandIn(0)
    shutdown(late, 0)
    setattr(late, shutdown_requests._AFTER_ENGINE_EXIT, lambda: ran.append("late"))
    shutdown(late, None)  # a later call stops nothing and leaves the hook alone
    assert len(ran) == 1


class _Engine:
    """AsyncLLM, and its output processor, as the after-exit step sees them."""

    def __init__(self, unfinished):
        self.request_states = {f"req-{i}": None for i in range(unfinished)}
        self.output_processor = self
        self.aborted = []

    def get_num_unfinished_requests(self):
        return len(self.request_states)

    def abort_requests(self, request_ids, internal):
        self.aborted.append((list(request_ids), internal))


@pytest.mark.parametrize("unfinished,aborted", [(0, []), (2, [(["req-0", "req-1"], True)])])
def test_after_exit_aborts_what_is_unfinished_and_cancels_the_output_handler(
    unfinished, aborted, monkeypatch
):
    """A request without its final output once the engine core is gone (it never took
    it, or had to be killed) gets an abort output on the event loop instead of hanging."""
    import asyncio

    monkeypatch.setattr(shutdown_requests, "_FINAL_OUTPUTS_WAIT_S", 0.2)
    engine = _Engine(unfinished)

    async def run():
        handler = asyncio.get_running_loop().create_task(asyncio.sleep(60))
        await asyncio.to_thread(
            shutdown_requests._end_output_handler,
            engine,
            handler,
            lambda task: task.get_loop().call_soon_threadsafe(task.cancel),
        )
        with pytest.raises(asyncio.CancelledError):
            await handler

    asyncio.run(run())
    assert engine.aborted == aborted


def test_async_llm_shutdown_marks_the_client_and_hands_the_manager_its_after_exit_step(monkeypatch):
    """And registers nothing at exit: how the API server's process leaves is the
    `deepinfer` CLI's business (vllm_deepinfer.serving.cli), not every AsyncLLM's."""
    from types import SimpleNamespace

    at_exit = []
    monkeypatch.setattr("atexit.register", at_exit.append)

    class Handler:
        def done(self):
            return False

    manager = EngineProcManagerStandIn(0)
    engine = SimpleNamespace(
        engine_core=SimpleNamespace(resources=SimpleNamespace(engine_manager=manager)),
        output_handler=Handler(),
    )
    seen = []

    def original(self, timeout=None):
        seen.append(
            (
                timeout,
                shutdown_requests.shutting_down(self),
                getattr(manager, shutdown_requests._AFTER_ENGINE_EXIT).args,
            )
        )

    assert not shutdown_requests.shutting_down(engine)
    shutdown_requests._wrap_async_llm_shutdown(original, "cancel")(engine, 0)
    assert seen == [(0, True, (engine, engine.output_handler, "cancel"))]
    assert at_exit == []


def test_the_renderer_outlives_the_engine_core():
    """Upstream shuts the renderer down first; a request being rendered then would fail
    with RuntimeError. It is shut down once the engine client has stopped."""
    from types import SimpleNamespace

    events = []

    class Renderer:
        def shutdown(self):
            events.append("renderer stopped")

    engine = SimpleNamespace(renderer=Renderer())

    def original(self, timeout=None):  # as upstream: the renderer first, then the engine
        self.renderer.shutdown()
        events.append("engine stopped")

    shutdown_requests._wrap_async_llm_shutdown(original, "cancel")(engine, 0)
    assert events == ["engine stopped", "renderer stopped"]
    assert "shutdown" not in vars(engine.renderer)


class _Processor:
    def __init__(self):
        self.calls = []

    def add_request(self, request, prompt, parent_req, index, queue):
        self.calls.append(("add", request.request_id))

    def abort_requests(self, request_ids, internal):
        self.calls.append(("abort", list(request_ids), internal))


@pytest.mark.parametrize("stopping", [False, True])
def test_a_request_added_while_shutting_down_ends_at_once(stopping):
    """Nothing would run it (the engine core is aborting, or gone): it gets its abort
    output at once instead of being sent to the engine core."""
    import asyncio
    from types import SimpleNamespace

    sent = []

    async def original(self, request, prompt, parent_req, index, queue):
        sent.append(request.request_id)

    engine = SimpleNamespace(
        output_processor=_Processor(),
        **{shutdown_requests._SHUTTING_DOWN: True} if stopping else {},
    )
    add = shutdown_requests._wrap_add_request(original)
    asyncio.run(add(engine, SimpleNamespace(request_id="cmpl-1"), None, None, 0, None))
    if stopping:
        assert sent == [] and engine.output_processor.calls == [
            ("add", "cmpl-1"),
            ("abort", ["cmpl-1"], True),
        ]
    else:
        assert sent == ["cmpl-1"] and engine.output_processor.calls == []


class _Serving:
    """vLLM's GenerateBaseServing as the wrapper sees it."""

    def __init__(self, engine_client):
        self.engine_client = engine_client

    def _raise_if_error(self, finish_reason, request_id):
        if finish_reason == "error":
            raise RuntimeError("upstream's error")


def _checked(finish_reason: str, stopping: bool):
    """vLLM's check of a finished request on its routes, wrapped, for a client that is
    (or is not) shutting down."""
    from types import SimpleNamespace

    from vllm.exceptions import RetryableRequestError

    client = SimpleNamespace(**{shutdown_requests._SHUTTING_DOWN: True} if stopping else {})
    check = shutdown_requests._wrap_raise_if_error(_Serving._raise_if_error, RetryableRequestError)
    return check(_Serving(client), finish_reason, "cmpl-1")


def test_vllm_routes_answer_a_shutdown_abort_with_a_retryable_error():
    from vllm.exceptions import RetryableRequestError

    with pytest.raises(RetryableRequestError) as error:
        _checked("abort", stopping=True)
    assert error.value.status_code == 503
    assert str(error.value) == shutdown_requests.SHUTDOWN_ABORT


@pytest.mark.parametrize(
    "finish_reason,stopping",
    [
        ("abort", False),  # e.g. /pause?mode=abort: the partial answer, as upstream gives it
        ("length", True),
        ("stop", True),
    ],
)
def test_other_finishes_are_left_to_upstream(finish_reason, stopping):
    assert _checked(finish_reason, stopping) is None


def test_upstream_check_still_runs():
    with pytest.raises(RuntimeError, match="upstream's error"):
        _checked("error", stopping=True)


def test_the_shutdown_abort_reads_as_the_deepseek_routes_do():
    from vllm_deepinfer.serving.chat_service import ABORTED

    assert shutdown_requests.SHUTDOWN_ABORT == ABORTED
