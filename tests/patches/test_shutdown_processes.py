"""The shutdown_processes patch: its guard and probe, and its wrappers on stand-ins. The
server-level behaviour is tests/serving/test_shutdown.py."""
import os
import signal

import pytest
from shutdown_parts import installed

from vllm_deepinfer.patches import shutdown_processes, shutdown_requests, shutdown_window
from vllm_deepinfer.patches.base import PatchUnavailable

pytestmark = pytest.mark.unit

_GRACE = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"


def test_applies_on_this_vllm_and_is_idempotent(shutdown_upstream):
    from vllm.v1.executor.multiproc_executor import WorkerProc

    assert shutdown_processes.apply()
    assert installed(shutdown_upstream, shutdown_processes)
    assert shutdown_processes.LEFT_TO_VLLM == ""
    wrapper = WorkerProc.worker_busy_loop
    assert shutdown_processes.apply()
    assert WorkerProc.worker_busy_loop is wrapper


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


def _fix_processes(monkeypatch, engine_core_main=_engine_core_main_stopping_in_order):
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.executor.multiproc_executor import WorkerProc

    monkeypatch.setattr(WorkerProc, "worker_main", staticmethod(_worker_main_leaving_sigint))
    monkeypatch.setattr(EngineCoreProc, "run_engine_core", staticmethod(engine_core_main))


def test_left_to_upstream_where_its_processes_stop_in_order(shutdown_upstream, monkeypatch):
    """Where upstream does what the patch restores, it is reported not needed, the workers'
    grace is left to vLLM, and the other shutdown patches apply all the same."""
    monkeypatch.delenv(_GRACE, raising=False)
    _fix_processes(monkeypatch)
    assert shutdown_processes.apply() is False
    assert not installed(shutdown_upstream, shutdown_processes)
    assert shutdown_processes.LEFT_TO_VLLM.startswith("leaves SIGINT to the API server")
    assert _GRACE not in os.environ
    assert shutdown_window.apply() and shutdown_requests.apply()
    assert installed(shutdown_upstream, shutdown_window)
    assert installed(shutdown_upstream, shutdown_requests)


@pytest.mark.parametrize("set_by_user,grace", [(None, "15"), ("7", "7")])
def test_workers_get_a_longer_exit_grace_unless_the_user_set_one(set_by_user, grace,
                                                                 shutdown_upstream, monkeypatch):
    """A worker leaving on a loaded machine took more than vLLM's 5 s (then it is killed):
    on the CPU its executor waits up to 15 s, or what the user set."""
    if set_by_user is not None:
        monkeypatch.setenv(_GRACE, set_by_user)
    else:
        monkeypatch.delenv(_GRACE, raising=False)
    assert shutdown_processes.apply()
    assert os.environ[_GRACE] == grace


def _worker_main_not_serving(*args, **kwargs):
    pass


def _engine_core_main_without_teardown(*args, **kwargs):
    pass


@pytest.mark.parametrize("cls,name,replacement,reason", [
    ("WorkerProc", "worker_main", staticmethod(_worker_main_not_serving),
     "no longer serves in worker_busy_loop"),
    ("EngineCoreProc", "run_engine_core", staticmethod(_engine_core_main_without_teardown),
     "no longer tears its engine core down after the busy loop"),
])
def test_unavailable_when_upstream_changes(cls, name, replacement, reason, shutdown_upstream,
                                           monkeypatch):
    from vllm.v1.engine import core
    from vllm.v1.executor import multiproc_executor

    owner = getattr(multiproc_executor, cls, None) or getattr(core, cls)
    monkeypatch.setattr(owner, name, replacement)
    with pytest.raises(PatchUnavailable, match=reason):
        shutdown_processes.apply()
    assert not installed(shutdown_upstream, shutdown_processes)


# --- the wrappers -------------------------------------------------------------------------

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

    outer = shutdown_processes._wrap_engine_core_teardown(
        lambda self: (inner(self), self.seen.append(signal.getsignal(signal.SIGTERM))))
    inner = shutdown_processes._wrap_engine_core_teardown(Core.teardown)
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
    monkeypatch.setattr(shutdown_processes.atexit, "register", at_exit.append)
    busy_loop = shutdown_processes._wrap_busy_loop(
        lambda self: seen.append(signal.getsignal(signal.SIGINT)))
    before = signal.getsignal(signal.SIGINT)
    try:
        busy_loop(object())
    finally:
        signal.signal(signal.SIGINT, before)
    assert seen == [signal.SIG_IGN]
    assert at_exit == [gc.freeze]


class _Queue:
    def __init__(self, shutting_down):
        self.shutting_down = shutting_down


@pytest.mark.parametrize("stopping", [False, True], ids=["serving", "executor-stopping"])
def test_a_worker_leaves_a_group_sigterm_to_its_engine_core(stopping, monkeypatch):
    """A SIGTERM to the whole process group reaches the worker mid-step: it serves on (its
    engine core stops it after the abort); once its executor is stopping it (the queue
    shut down by the death pipe) upstream's handler ends it."""
    monkeypatch.setattr(shutdown_processes.atexit, "register", lambda function: None)
    upstream_calls = []

    class Worker:
        rpc_broadcast_mq = _Queue(stopping)

        def worker_busy_loop(self):
            os.kill(os.getpid(), signal.SIGTERM)  # handled before the next bytecode
            return "served"

    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, lambda signum, frame: upstream_calls.append(signum))
    try:
        assert shutdown_processes._wrap_worker_busy_loop(Worker.worker_busy_loop)(Worker()) \
            == "served"
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)
    assert upstream_calls == ([signal.SIGTERM] if stopping else [])
