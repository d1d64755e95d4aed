"""The clean_shutdown patch: its guard on the installed vLLM (applies; not needed where
upstream grants the CPU a teardown window; refuses an upstream that changed) and its three
wrappers on stand-ins. The server-level behaviour is tests/serving/test_shutdown.py."""
import signal
import weakref

import pytest

from vllm_deepinfer.patches import clean_shutdown
from vllm_deepinfer.patches.base import PatchUnavailable

pytestmark = pytest.mark.unit


@pytest.fixture
def upstream(monkeypatch):
    """The three classes the patch changes, as upstream wrote them (an engine started
    earlier in this process installed the wrappers), put back after each test."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.utils import CoreEngineProcManager
    from vllm.v1.executor.multiproc_executor import WorkerProc

    for cls, name in ((CoreEngineProcManager, "shutdown"), (AsyncLLM, "shutdown"),
                      (WorkerProc, "worker_busy_loop")):
        method = cls.__dict__[name]
        monkeypatch.setattr(cls, name, getattr(method, "__wrapped__", method)
                            if getattr(method, "_deepinfer_clean_shutdown", False) else method)
    return CoreEngineProcManager, AsyncLLM, WorkerProc


def _installed(upstream) -> list[bool]:
    manager_cls, async_llm_cls, worker_cls = upstream
    return [getattr(method, "_deepinfer_clean_shutdown", False) for method in (
        manager_cls.shutdown, async_llm_cls.shutdown, worker_cls.worker_busy_loop)]


# --- the guard ----------------------------------------------------------------------------

def test_applies_on_this_vllm_and_is_idempotent(upstream):
    from vllm.v1.engine import utils

    assert utils.get_engine_process_shutdown_timeout(0, 0) == 0  # the reason it exists
    assert clean_shutdown.apply()
    assert _installed(upstream) == [True, True, True]
    wrapper = upstream[0].shutdown
    assert clean_shutdown.apply()
    assert upstream[0].shutdown is wrapper


def test_not_needed_where_upstream_grants_the_cpu_a_window(upstream, monkeypatch):
    from vllm.v1.engine import utils

    monkeypatch.setattr(utils, "get_engine_process_shutdown_timeout", lambda request, process: 15.0)
    assert clean_shutdown.apply() is False
    assert _installed(upstream) == [False, False, False]


def _manager_shutdown_without_derivation(self, timeout=None):
    pass


def _handle_shutdown_without_abort(self):
    return False


def _async_llm_shutdown_renamed(self, deadline=None):
    pass


def _worker_main_without_sigint(*args, **kwargs):
    pass


@pytest.mark.parametrize("module,cls,name,replacement,reason", [
    ("vllm.v1.engine.utils", "CoreEngineProcManager", "shutdown",
     _manager_shutdown_without_derivation, "no longer derives the process timeout"),
    ("vllm.v1.engine.core", "EngineCoreProc", "_handle_shutdown",
     _handle_shutdown_without_abort, "no longer aborts in-flight requests"),
    ("vllm.v1.engine.async_llm", "AsyncLLM", "shutdown",
     _async_llm_shutdown_renamed, r"no longer takes \(self, timeout\)"),
    ("vllm.v1.executor.multiproc_executor", "WorkerProc", "worker_main",
     staticmethod(_worker_main_without_sigint), "no longer handles SIGINT"),
])
def test_unavailable_when_upstream_changes(module, cls, name, replacement, reason, upstream,
                                           monkeypatch):
    import importlib

    monkeypatch.setattr(getattr(importlib.import_module(module), cls), name, replacement)
    with pytest.raises(PatchUnavailable, match=reason):
        clean_shutdown.apply()
    assert _installed(upstream) == [False, False, False]


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
    (0, None, None),   # best-effort paths: upstream's default
])
def test_manager_gets_a_window_in_abort_mode_only(request_timeout, timeout, expected,
                                                  monkeypatch):
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", 5, raising=False)
    manager = _Manager(request_timeout)
    clean_shutdown._wrap_manager_shutdown(_Manager.shutdown)(manager, timeout)
    assert manager.timeouts == [12.0 if expected == "window" else expected]


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
    """AsyncLLM as the after-exit step sees it."""

    def __init__(self, unfinished):
        self.unfinished = unfinished
        self.output_processor = self
        self.errors = []

    def get_num_unfinished_requests(self):
        return self.unfinished

    def propagate_error(self, error):
        self.errors.append(type(error).__name__)


@pytest.mark.parametrize("unfinished,errors", [(0, []), (1, ["EngineDeadError"])])
def test_after_exit_fails_what_is_unfinished_and_cancels_the_output_handler(
        unfinished, errors, monkeypatch):
    """A request without its final output once the engine core is gone (it had to be
    killed) gets EngineDeadError on the event loop instead of hanging."""
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
    assert engine.errors == errors


def test_async_llm_shutdown_hands_the_manager_its_after_exit_step():
    from types import SimpleNamespace

    class Handler:
        def done(self):
            return False

    manager = _Manager(0)
    engine = SimpleNamespace(engine_core=SimpleNamespace(
        resources=SimpleNamespace(engine_manager=manager)), output_handler=Handler())
    seen = []

    def original(self, timeout=None):
        seen.append((timeout, getattr(manager, clean_shutdown._AFTER_ENGINE_EXIT).args))

    clean_shutdown._wrap_async_llm_shutdown(original, "cancel")(engine, 0)
    assert seen == [(0, (engine, engine.output_handler, "cancel"))]


def test_workers_ignore_sigint_while_they_serve():
    seen = []
    busy_loop = clean_shutdown._wrap_worker_busy_loop(
        lambda self: seen.append(signal.getsignal(signal.SIGINT)))
    before = signal.getsignal(signal.SIGINT)
    try:
        busy_loop(object())
    finally:
        signal.signal(signal.SIGINT, before)
    assert seen == [signal.SIG_IGN]
