"""The shutdown_processes patch: its guard and probe, its wrappers on stand-ins, and the
quick exit it arms (vllm_deepinfer.process_exit) in real interpreters. The server-level
behaviour is tests/serving/test_shutdown.py."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from shutdown_parts import installed

from vllm_deepinfer import process_exit
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
    """A worker that serves until its death pipe closes, with no signal handler, and
    leaves without finalization (read by the probe, never run)."""
    worker = worker_cls(*args, **kwargs)
    worker.monitor_death_pipe()
    worker.worker_busy_loop()
    os._exit(0)


def _engine_core_main_stopping_in_order(engine_core_cls, *args, **kwargs):
    """An engine core that keeps its SIGTERM handler through its teardown, leaves SIGINT
    alone and leaves without finalization on every platform (read, never run)."""
    engine_core = engine_core_cls(*args, **kwargs)
    try:
        engine_core.run_busy_loop()
    finally:
        engine_core.shutdown()
        os._exit(0)


def _engine_core_main_freezing_its_heap(engine_core_cls, *args, **kwargs):
    """As above, but freezing its heap at exit instead (Triton's leak report follows)."""
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


def test_a_heap_frozen_at_exit_is_not_upstream_doing_it(shutdown_upstream, monkeypatch):
    _fix_processes(monkeypatch, _engine_core_main_freezing_its_heap)
    assert shutdown_processes.apply()
    assert installed(shutdown_upstream, shutdown_processes)


@pytest.mark.parametrize("set_by_user,grace", [(None, "15"), ("7", "7")])
def test_workers_get_a_longer_exit_grace_unless_the_user_set_one(
    set_by_user, grace, shutdown_upstream, monkeypatch
):
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


@pytest.mark.parametrize(
    "cls,name,replacement,reason",
    [
        (
            "WorkerProc",
            "worker_main",
            staticmethod(_worker_main_not_serving),
            "no longer serves in worker_busy_loop",
        ),
        (
            "EngineCoreProc",
            "run_engine_core",
            staticmethod(_engine_core_main_without_teardown),
            "no longer tears its engine core down after the busy loop",
        ),
    ],
)
def test_unavailable_when_upstream_changes(
    cls, name, replacement, reason, shutdown_upstream, monkeypatch
):
    from vllm.v1.engine import core
    from vllm.v1.executor import multiproc_executor

    owner = getattr(multiproc_executor, cls, None) or getattr(core, cls)
    monkeypatch.setattr(owner, name, replacement)
    with pytest.raises(PatchUnavailable, match=reason):
        shutdown_processes.apply()
    assert not installed(shutdown_upstream, shutdown_processes)


# --- the wrappers -------------------------------------------------------------------------


@pytest.fixture
def armed(monkeypatch):
    """The statuses the wrappers armed the quick exit with (nothing is armed for real)."""
    statuses = []
    monkeypatch.setattr(process_exit, "leave_after_exit_handlers", statuses.append)
    return statuses


def test_an_engine_core_finishes_its_teardown_whatever_sigterm_comes(armed):
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

    outer = shutdown_processes._wrap_teardown(
        lambda self: (inner(self), self.seen.append(signal.getsignal(signal.SIGTERM))),
        sigterm_deaf=True,
    )
    inner = shutdown_processes._wrap_teardown(Core.teardown, sigterm_deaf=True)
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
    assert armed == []  # neither stopped cleanly: their busy loops never ran


def test_workers_and_engine_cores_ignore_sigint(armed):
    """A terminal's SIGINT is the API server's to act on: it stops the engine cores
    (SIGTERM), which stop their workers, in that order."""
    seen = []
    busy_loop = shutdown_processes._wrap_busy_loop(
        lambda self: seen.append(signal.getsignal(signal.SIGINT))
    )
    before = signal.getsignal(signal.SIGINT)
    try:
        busy_loop(type("Process", (), {})())
    finally:
        signal.signal(signal.SIGINT, before)
    assert seen == [signal.SIG_IGN]


class _Queue:
    def __init__(self, shutting_down):
        self.shutting_down = shutting_down


@pytest.mark.parametrize(
    "ending,shutting_down,leaves_quickly",
    [
        (SystemExit(), False, True),  # an engine core's busy loop at a shutdown request
        (SystemExit(0), False, True),
        (SystemExit(1), False, False),
        (RuntimeError("cancelled"), True, True),  # a worker's queue closed by its executor
        (RuntimeError("boom"), False, False),  # a worker's or engine core's failure
    ],
    ids=["exit", "exit-0", "exit-1", "queue-closed", "failure"],
)
def test_a_clean_stop_and_teardown_leave_without_finalization(
    ending, shutting_down, leaves_quickly, armed
):
    """At exit the interpreter's GC scan of the heap took seconds of CPU (past the teardown
    window on a loaded machine), and a frozen heap made Triton's bindings report 150 lines
    of leaks: after a clean stop and teardown the process leaves without finalization;
    after a failure it exits as usual."""

    class Process:
        rpc_broadcast_mq = _Queue(shutting_down)
        torn_down = False

        def serve(self):
            raise ending

        def teardown(self):
            self.torn_down = True

    process = Process()
    busy_loop = shutdown_processes._wrap_busy_loop(Process.serve)
    teardown = shutdown_processes._wrap_teardown(Process.teardown, sigterm_deaf=False)
    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(type(ending)):
            busy_loop(process)
        assert armed == []  # not before its teardown
        teardown(process)
    finally:
        signal.signal(signal.SIGINT, before)
    assert process.torn_down
    assert armed == ([0] if leaves_quickly else [])


def test_a_failed_teardown_leaves_as_usual(armed):
    class Process:
        def serve(self):
            raise SystemExit()

        def teardown(self):
            raise RuntimeError("teardown failed")

    process = Process()
    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):
            shutdown_processes._wrap_busy_loop(Process.serve)(process)
    finally:
        signal.signal(signal.SIGINT, before)
    with pytest.raises(RuntimeError, match="teardown failed"):
        shutdown_processes._wrap_teardown(Process.teardown, sigterm_deaf=True)(process)
    assert armed == []


@pytest.mark.parametrize("stopping", [False, True], ids=["serving", "executor-stopping"])
def test_a_worker_leaves_a_group_sigterm_to_its_engine_core(stopping):
    """A SIGTERM to the whole process group reaches the worker mid-step: it serves on (its
    engine core stops it after the abort); once its executor is stopping it (the queue
    shut down by the death pipe) upstream's handler ends it."""
    upstream_calls = []

    class Worker:
        rpc_broadcast_mq = _Queue(stopping)

        def worker_busy_loop(self):
            os.kill(os.getpid(), signal.SIGTERM)  # handled before the next bytecode
            return "served"

    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, lambda signum, frame: upstream_calls.append(signum))
    try:
        assert (
            shutdown_processes._wrap_worker_busy_loop(Worker.worker_busy_loop)(Worker()) == "served"
        )
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)
    assert upstream_calls == ([signal.SIGTERM] if stopping else [])


# --- the quick exit, in real interpreters --------------------------------------------------

_EXIT = """
import atexit, gc, sys
import triton._C.libtriton  # nanobind bindings: they report objects alive at their teardown
from vllm_deepinfer import process_exit
atexit.register(print, "registered before")
process_exit.leave_after_exit_handlers({status})
{after}
gc.freeze()  # what made the leak report: the heap is never freed
print("served")
sys.stdout.write("unflushed;")
sys.exit({exit_status})
"""


def _run_exit(status=0, after="", exit_status=0) -> subprocess.CompletedProcess:
    code = textwrap.dedent(_EXIT).format(status=status, after=after, exit_status=exit_status)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def _triton_reports_leaks() -> bool:
    """Whether this Triton's bindings report objects alive at a frozen heap's finalization,
    the evidence the tests below read (Triton builds differ: 3.9 reports them, the 3.8 that
    vLLM 0.34's torch pins does not)."""
    code = "import gc, triton._C.libtriton\ngc.freeze()\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return "nanobind: leaked" in run.stderr


def test_an_armed_process_runs_its_exit_handlers_once_and_skips_finalization():
    """Armed again after another handler was registered (the arming moves it last): every
    other handler runs once, newest first, stdout is flushed, and the process ends before
    the finalization that printed Triton's leak report."""
    run = _run_exit(
        status=0,
        exit_status=0,
        after=(
            "atexit.register(print, 'registered after'); process_exit.leave_after_exit_handlers(0)"
        ),
    )
    assert run.returncode == 0
    assert run.stdout.splitlines() == ["served", "unflushed;registered after", "registered before"]
    assert "leaked" not in run.stderr, run.stderr[-2000:]


def test_an_armed_process_ends_with_its_status():
    run = _run_exit(status=3, exit_status=0)
    assert run.returncode == 3 and "leaked" not in run.stderr
    assert run.stdout.splitlines() == ["served", "unflushed;registered before"]


def test_a_handler_registered_after_the_arming_makes_it_exit_as_usual():
    """That handler has run already: the process finishes the usual way (its own status,
    every handler once) rather than run it twice."""
    run = _run_exit(status=0, after="atexit.register(print, 'registered after')", exit_status=4)
    assert run.returncode == 4
    assert run.stdout.splitlines() == ["served", "unflushed;registered after", "registered before"]
    if _triton_reports_leaks():  # the usual finalization, frozen heap and all
        assert "nanobind: leaked" in run.stderr
