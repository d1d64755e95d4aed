"""The clean_shutdown patch: its guard on the installed vLLM (each of its three parts
applies unless upstream does what it restores, on its own; refuses an upstream that
changed) and its wrappers on stand-ins. The server-level behaviour is
tests/serving/test_shutdown.py."""
import signal
import weakref

import pytest

from vllm_deepinfer.patches import clean_shutdown
from vllm_deepinfer.patches.base import PatchUnavailable

pytestmark = pytest.mark.unit


_GRACE = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
# The patch's three parts, as `clean_shutdown.PARTS` names them.
PROCESSES, WINDOW, FRONT_END = ("process teardown and signals", "teardown window",
                                "request endings at shutdown")


@pytest.fixture
def upstream(monkeypatch):
    """The methods each part changes, by part, as upstream wrote them (an engine started
    earlier in this process installed the wrappers), and the workers' exit grace as the
    environment has it (`apply` sets a default); all put back after each test."""
    import os

    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc
    from vllm.v1.engine.utils import CoreEngineProcManager
    from vllm.v1.executor.multiproc_executor import WorkerProc

    parts = {
        PROCESSES: ((WorkerProc, "worker_busy_loop"), (EngineCoreProc, "run_busy_loop"),
                    (DPEngineCoreProc, "run_busy_loop"), (EngineCoreProc, "shutdown"),
                    (DPEngineCoreProc, "shutdown")),
        WINDOW: ((CoreEngineProcManager, "shutdown"),),
        FRONT_END: ((AsyncLLM, "shutdown"), (AsyncLLM, "_add_request"),
                    (GenerateBaseServing, "_raise_if_error")),
    }
    for methods in parts.values():
        for cls, name in methods:
            method = getattr(cls, name)
            monkeypatch.setattr(cls, name, getattr(method, "__wrapped__", method)
                                if getattr(method, "_deepinfer_clean_shutdown", False)
                                else method)
    monkeypatch.setenv(_GRACE, os.environ.get(_GRACE, ""))
    if not os.environ[_GRACE]:
        monkeypatch.delenv(_GRACE)
    return parts


def _installed(parts) -> dict[str, bool]:
    """Whether each part's wrappers are installed (all of a part's, or none)."""
    installed = {}
    for part, methods in parts.items():
        marks = {getattr(getattr(cls, name), "_deepinfer_clean_shutdown", False)
                 for cls, name in methods}
        assert len(marks) == 1, f"{part} is half installed"
        installed[part] = marks.pop()
    return installed


def _vllm_033_window(request_timeout, process_timeout):
    """vLLM 0.33's get_engine_process_shutdown_timeout on the CPU: a set
    VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS becomes the window after the abort."""
    import os

    import vllm.envs as envs

    if request_timeout == 0 and process_timeout == 0 and _GRACE in os.environ:
        return float(envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS)
    return process_timeout


# --- the guard ----------------------------------------------------------------------------

def test_every_part_applies_on_this_vllm_and_is_idempotent(upstream):
    """Upstream's window, where it grants one on the CPU, is shorter than the patch's."""
    from vllm.v1.engine import utils

    assert (utils.get_engine_process_shutdown_timeout(0, 0) or 0) \
        < clean_shutdown.teardown_window_s()
    assert clean_shutdown.apply()
    assert all(_installed(upstream).values())
    assert clean_shutdown.PARTS == dict.fromkeys(upstream, clean_shutdown.ACTIVE)
    wrapper = upstream[WINDOW][0][0].shutdown
    assert clean_shutdown.apply()
    assert upstream[WINDOW][0][0].shutdown is wrapper


@pytest.mark.parametrize("set_by_user", [None, "5", "7", "15"])
def test_every_part_applies_where_the_workers_grace_is_set(set_by_user, upstream,
                                                            monkeypatch):
    """vLLM 0.33 returns a set VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS as its window on every
    platform: the workers' grace alone, set by the user or by the patch's own default
    (None). That is no teardown window: the patch keeps its own, and the other parts."""
    from vllm.v1.engine import utils

    if set_by_user is not None:
        monkeypatch.setenv(_GRACE, set_by_user)
    monkeypatch.setattr(utils, "get_engine_process_shutdown_timeout", _vllm_033_window)
    assert clean_shutdown.apply()
    assert all(_installed(upstream).values())
    assert clean_shutdown.PARTS[WINDOW] == clean_shutdown.ACTIVE


def test_every_part_applies_with_this_vllms_window_and_a_users_grace(upstream, monkeypatch):
    """As above, through the installed vLLM's own get_engine_process_shutdown_timeout."""
    monkeypatch.setenv(_GRACE, "7")
    assert clean_shutdown.apply()
    assert all(_installed(upstream).values())


@pytest.mark.parametrize("upstream_window", [lambda: 0, lambda: None, lambda: 15.0,
                                             lambda: clean_shutdown.teardown_window_s() - 1],
                         ids=["zero", "none", "15s", "just-short"])
def test_keeps_its_window_where_upstreams_is_shorter(upstream_window, upstream, monkeypatch):
    from vllm.v1.engine import utils

    monkeypatch.setattr(utils, "get_engine_process_shutdown_timeout",
                        lambda request, process: upstream_window())
    assert clean_shutdown.apply()
    assert all(_installed(upstream).values())


@pytest.mark.parametrize("longer_by", [0, 30])
def test_window_left_to_upstream_where_it_is_as_long_the_rest_applies(longer_by, upstream,
                                                                      monkeypatch):
    """The patch's window, as upstream's is compared with it, counts the workers' exit grace
    the processes' part sets first."""
    from vllm.v1.engine import utils

    monkeypatch.setattr(utils, "get_engine_process_shutdown_timeout",
                        lambda request, process: clean_shutdown.teardown_window_s() + longer_by)
    assert clean_shutdown.apply()
    assert _installed(upstream) == {PROCESSES: True, WINDOW: False, FRONT_END: True}
    upstream_window = clean_shutdown.teardown_window_s() + longer_by
    assert clean_shutdown.PARTS[WINDOW].startswith(
        f"{clean_shutdown.FIXED_UPSTREAM}: it grants the engine core {upstream_window:g} s")


def _worker_main_leaving_sigint(worker_cls, *args, **kwargs):
    """A worker that serves until its death pipe closes, with no signal handler (read by
    the probe, never run)."""
    worker = worker_cls(*args, **kwargs)
    worker.monitor_death_pipe()
    worker.worker_busy_loop()


def _engine_core_main_stopping_in_order(engine_core_cls, *args, **kwargs):
    """An engine core that keeps its SIGTERM handler through its teardown, leaves SIGINT
    alone and freezes its heap at exit on every platform (read, never run)."""
    import gc

    engine_core = engine_core_cls(*args, **kwargs)
    try:
        engine_core.run_busy_loop()
    finally:
        engine_core.shutdown()
        gc.freeze()


def _raise_if_error_failing_aborts(self, finish_reason, request_id):
    from vllm.exceptions import RetryableRequestError

    if finish_reason in ("abort", "error"):
        raise RetryableRequestError("aborted")


def _fix_processes(monkeypatch):
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.executor.multiproc_executor import WorkerProc

    monkeypatch.setattr(WorkerProc, "worker_main", staticmethod(_worker_main_leaving_sigint))
    monkeypatch.setattr(EngineCoreProc, "run_engine_core",
                        staticmethod(_engine_core_main_stopping_in_order))


def _fix_window(monkeypatch):
    from vllm.v1.engine import utils

    monkeypatch.setattr(utils, "get_engine_process_shutdown_timeout",
                        lambda request, process: 120.0)


def _fix_front_end(monkeypatch):
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing

    monkeypatch.setattr(GenerateBaseServing, "_raise_if_error", _raise_if_error_failing_aborts)


_FIXES = {PROCESSES: _fix_processes, WINDOW: _fix_window, FRONT_END: _fix_front_end}


@pytest.mark.parametrize("fixed", [PROCESSES, FRONT_END])
def test_a_part_upstream_does_is_skipped_and_the_others_apply(fixed, upstream, monkeypatch):
    """Each part's probe on its own: where upstream does what one part restores, that part
    is reported fixed upstream and the others are installed all the same."""
    import os

    monkeypatch.delenv(_GRACE, raising=False)
    _FIXES[fixed](monkeypatch)
    assert clean_shutdown.apply()
    assert _installed(upstream) == {part: part != fixed for part in upstream}
    assert clean_shutdown.PARTS[fixed].startswith(clean_shutdown.FIXED_UPSTREAM)
    # The workers' grace is the processes' part's: left to vLLM with it.
    assert (_GRACE in os.environ) == (fixed != PROCESSES)


def test_not_needed_where_upstream_does_all_three(upstream, monkeypatch):
    for fix in _FIXES.values():
        fix(monkeypatch)
    assert clean_shutdown.apply() is False
    assert not any(_installed(upstream).values())
    assert all(state.startswith(clean_shutdown.FIXED_UPSTREAM)
               for state in clean_shutdown.PARTS.values())


@pytest.mark.parametrize("set_by_user,grace", [(None, "15"), ("7", "7")])
def test_workers_get_a_longer_exit_grace_unless_the_user_set_one(set_by_user, grace,
                                                                 upstream, monkeypatch):
    """A worker leaving on a loaded machine took more than vLLM's 5 s (then it is killed):
    on the CPU its executor waits up to 15 s, or what the user set."""
    import os

    if set_by_user is not None:
        monkeypatch.setenv(_GRACE, set_by_user)
    assert clean_shutdown.apply()
    assert os.environ[_GRACE] == grace


def _manager_shutdown_without_derivation(self, timeout=None):
    pass


def _handle_shutdown_without_abort(self):
    return False


def _async_llm_shutdown_renamed(self, deadline=None):
    pass


def _worker_main_not_serving(*args, **kwargs):
    pass


@pytest.mark.parametrize("module,cls,name,replacement,reason", [
    ("vllm.v1.engine.utils", "CoreEngineProcManager", "shutdown",
     _manager_shutdown_without_derivation, "no longer derives the process timeout"),
    ("vllm.v1.engine.core", "EngineCoreProc", "_handle_shutdown",
     _handle_shutdown_without_abort, "no longer aborts in-flight requests"),
    ("vllm.v1.engine.async_llm", "AsyncLLM", "shutdown",
     _async_llm_shutdown_renamed, r"no longer takes \(self, timeout\)"),
    ("vllm.v1.executor.multiproc_executor", "WorkerProc", "worker_main",
     staticmethod(_worker_main_not_serving), "no longer serves in worker_busy_loop"),
])
def test_unavailable_when_upstream_changes(module, cls, name, replacement, reason, upstream,
                                           monkeypatch):
    import importlib

    monkeypatch.setattr(getattr(importlib.import_module(module), cls), name, replacement)
    with pytest.raises(PatchUnavailable, match=reason):
        clean_shutdown.apply()
    assert not any(_installed(upstream).values())


# --- the wrappers -------------------------------------------------------------------------

class _Manager:
    """CoreEngineProcManager as the wrapper sees it: stops its engine once."""

    def __init__(self, request_timeout):
        self._request_shutdown_timeout = request_timeout
        self._finalizer = weakref.finalize(self, lambda: None)
        self.timeouts = []

    def shutdown(self, timeout=None):
        self._finalizer.detach()
        self.timeouts.append(timeout)


@pytest.mark.parametrize("request_timeout,timeout,expected", [
    (0, 0, "window"),  # abort mode: the engine core gets its teardown window
    (30, 30, 30),      # drain mode (--shutdown-timeout 30): the user's timeout
    (0, None, "window"),  # the finalizer's path: upstream's 5 s would cut the teardown
    (0, 15, "window"),    # the client's clean-up: VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS
    (0, 60, 60),          # longer than the window: kept
])
def test_manager_gets_a_window_in_abort_mode_only(request_timeout, timeout, expected,
                                                  monkeypatch):
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", 5, raising=False)
    manager = _Manager(request_timeout)
    clean_shutdown._wrap_manager_shutdown(_Manager.shutdown)(manager, timeout)
    assert manager.timeouts == [24.0 if expected == "window" else expected]


def test_after_exit_runs_once_in_the_call_that_stopped_the_engine():
    manager, ran = _Manager(0), []
    shutdown = clean_shutdown._wrap_manager_shutdown(_Manager.shutdown)
    setattr(manager, clean_shutdown._AFTER_ENGINE_EXIT, lambda: ran.append(manager.timeouts[:]))
    shutdown(manager, 0)
    assert ran == [[clean_shutdown.teardown_window_s()]]  # after the engine core stopped
    shutdown(manager, None)  # e.g. its liveness monitor, once it saw the manager stop
    assert len(ran) == 1

    late = _Manager(0)
    shutdown(late, 0)
    setattr(late, clean_shutdown._AFTER_ENGINE_EXIT, lambda: ran.append("late"))
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
        unfinished, aborted, monkeypatch):
    """A request without its final output once the engine core is gone (it never took
    it, or had to be killed) gets an abort output on the event loop instead of hanging."""
    import asyncio

    monkeypatch.setattr(clean_shutdown, "_FINAL_OUTPUTS_WAIT_S", 0.2)
    engine = _Engine(unfinished)

    async def run():
        handler = asyncio.get_running_loop().create_task(asyncio.sleep(60))
        await asyncio.to_thread(clean_shutdown._end_output_handler, engine, handler,
                                lambda task: task.get_loop().call_soon_threadsafe(task.cancel))
        with pytest.raises(asyncio.CancelledError):
            await handler

    asyncio.run(run())
    assert engine.aborted == aborted


def test_async_llm_shutdown_marks_the_client_and_hands_the_manager_its_after_exit_step(
        monkeypatch):
    import gc
    from types import SimpleNamespace

    at_exit = []
    monkeypatch.setattr(clean_shutdown.atexit, "register", at_exit.append)

    class Handler:
        def done(self):
            return False

    manager = _Manager(0)
    engine = SimpleNamespace(engine_core=SimpleNamespace(
        resources=SimpleNamespace(engine_manager=manager)), output_handler=Handler())
    seen = []

    def original(self, timeout=None):
        seen.append((timeout, clean_shutdown.shutting_down(self),
                     getattr(manager, clean_shutdown._AFTER_ENGINE_EXIT).args))

    assert not clean_shutdown.shutting_down(engine)
    clean_shutdown._wrap_async_llm_shutdown(original, "cancel")(engine, 0)
    assert seen == [(0, True, (engine, engine.output_handler, "cancel"))]
    assert at_exit == [gc.freeze]


def test_the_renderer_outlives_the_engine_core(monkeypatch):
    """Upstream shuts the renderer down first; a request being rendered then would fail
    with RuntimeError. It is shut down once the engine client has stopped."""
    from types import SimpleNamespace

    monkeypatch.setattr(clean_shutdown.atexit, "register", lambda function: None)

    events = []

    class Renderer:
        def shutdown(self):
            events.append("renderer stopped")

    engine = SimpleNamespace(renderer=Renderer())

    def original(self, timeout=None):  # as upstream: the renderer first, then the engine
        self.renderer.shutdown()
        events.append("engine stopped")

    clean_shutdown._wrap_async_llm_shutdown(original, "cancel")(engine, 0)
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

    engine = SimpleNamespace(output_processor=_Processor(),
                             **{clean_shutdown._SHUTTING_DOWN: True} if stopping else {})
    add = clean_shutdown._wrap_add_request(original)
    asyncio.run(add(engine, SimpleNamespace(request_id="cmpl-1"), None, None, 0, None))
    if stopping:
        assert sent == [] and engine.output_processor.calls == [
            ("add", "cmpl-1"), ("abort", ["cmpl-1"], True)]
    else:
        assert sent == ["cmpl-1"] and engine.output_processor.calls == []


def test_an_engine_core_finishes_its_teardown_whatever_sigterm_comes():
    """The SIGTERM its process manager sends after a group SIGTERM no longer ends the
    engine core mid-teardown (upstream resets the handler to the default first); the
    handler it had is back afterwards, and a nested teardown (the DP engine core's calls
    its base's) leaves the outer one in charge."""
    import threading

    class Core:
        def __init__(self):
            self.seen = []

        def teardown(self):
            self.seen.append(signal.getsignal(signal.SIGTERM))

    outer = clean_shutdown._wrap_engine_core_teardown(
        lambda self: (inner(self), self.seen.append(signal.getsignal(signal.SIGTERM))))
    inner = clean_shutdown._wrap_engine_core_teardown(Core.teardown)
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        core = Core()
        outer(core)
        assert core.seen == [signal.SIG_IGN, signal.SIG_IGN]
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        other = Core()  # off the main thread (an in-process engine's): left alone
        thread = threading.Thread(target=inner, args=(other,))
        thread.start()
        thread.join()
        assert other.seen == [signal.SIG_DFL]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_workers_and_engine_cores_ignore_sigint_and_skip_the_exit_scan(monkeypatch):
    """A terminal's SIGINT is the API server's to act on: it stops the engine cores
    (SIGTERM), which stop their workers, in that order. At exit their heap is frozen: the
    interpreter's final cyclic-GC scan of it took seconds of CPU (past the teardown window
    on a loaded machine), and the OS reclaims it anyway."""
    import gc

    seen, at_exit = [], []
    monkeypatch.setattr(clean_shutdown.atexit, "register", at_exit.append)
    busy_loop = clean_shutdown._wrap_busy_loop(
        lambda self: seen.append(signal.getsignal(signal.SIGINT)))
    before = signal.getsignal(signal.SIGINT)
    try:
        busy_loop(object())
    finally:
        signal.signal(signal.SIGINT, before)
    assert seen == [signal.SIG_IGN]
    assert at_exit == [gc.freeze]


@pytest.mark.parametrize("stopping", [False, True], ids=["serving", "executor-stopping"])
def test_a_worker_leaves_a_group_sigterm_to_its_engine_core(stopping, monkeypatch):
    """A SIGTERM to the whole process group reaches the worker mid-step: it serves on (its
    engine core stops it after the abort); once its executor is stopping it (the queue
    shut down by the death pipe) upstream's handler ends it."""
    import os
    from types import SimpleNamespace

    monkeypatch.setattr(clean_shutdown.atexit, "register", lambda function: None)
    upstream_calls = []

    class Worker:
        rpc_broadcast_mq = SimpleNamespace(shutting_down=stopping)

        def worker_busy_loop(self):
            os.kill(os.getpid(), signal.SIGTERM)  # handled before the next bytecode
            return "served"

    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, lambda signum, frame: upstream_calls.append(signum))
    try:
        assert clean_shutdown._wrap_worker_busy_loop(Worker.worker_busy_loop)(Worker()) \
            == "served"
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)
    assert upstream_calls == ([signal.SIGTERM] if stopping else [])


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

    client = SimpleNamespace(**{clean_shutdown._SHUTTING_DOWN: True} if stopping else {})
    check = clean_shutdown._wrap_raise_if_error(_Serving._raise_if_error,
                                                RetryableRequestError)
    return check(_Serving(client), finish_reason, "cmpl-1")


def test_vllm_routes_answer_a_shutdown_abort_with_a_retryable_error():
    from vllm.exceptions import RetryableRequestError

    with pytest.raises(RetryableRequestError) as error:
        _checked("abort", stopping=True)
    assert error.value.status_code == 503 and str(error.value) == clean_shutdown.SHUTDOWN_ABORT


@pytest.mark.parametrize("finish_reason,stopping", [
    ("abort", False),  # e.g. /pause?mode=abort: the partial answer, as upstream gives it
    ("length", True), ("stop", True)])
def test_other_finishes_are_left_to_upstream(finish_reason, stopping):
    assert _checked(finish_reason, stopping) is None


def test_upstream_check_still_runs():
    with pytest.raises(RuntimeError, match="upstream's error"):
        _checked("error", stopping=True)


def test_the_shutdown_abort_reads_as_the_deepseek_routes_do():
    from vllm_deepinfer.serving.chat_service import ABORTED

    assert clean_shutdown.SHUTDOWN_ABORT == ABORTED
