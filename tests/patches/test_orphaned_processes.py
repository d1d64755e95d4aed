"""The orphaned_processes patch: its guard and probe, and both of its behaviours in real
processes (a failed start that returns, an engine core that stops with its parent); the
engine-level failed start is the last test."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from shutdown_parts import installed

from vllm_deepinfer.patches import orphaned_processes
from vllm_deepinfer.patches.base import PatchUnavailable

unit = pytest.mark.unit


@unit
def test_applies_on_this_vllm_and_is_idempotent(shutdown_upstream):
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    assert orphaned_processes.apply()
    assert installed(shutdown_upstream, orphaned_processes)
    wrapper = MultiprocExecutor._init_executor
    assert orphaned_processes.apply()
    assert installed(shutdown_upstream, orphaned_processes)
    assert MultiprocExecutor._init_executor is wrapper


@unit
def test_left_to_vllm_where_upstream_stops_its_orphans(shutdown_upstream, monkeypatch):
    sources = {
        "_init_executor": "multiprocessing.util.Finalize(self, self.shutdown)",
        "run_engine_core": "parent = multiprocessing.parent_process()",
    }
    monkeypatch.setattr(
        orphaned_processes, "source_of", lambda _, symbol: sources[symbol.rpartition(".")[2]]
    )
    assert orphaned_processes.apply() is False
    assert not installed(shutdown_upstream, orphaned_processes)
    assert orphaned_processes.LEFT_TO_VLLM.startswith("stops its workers")


@unit
def test_unavailable_when_upstream_changes(shutdown_upstream, monkeypatch):
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    monkeypatch.delattr(MultiprocExecutor, "_init_executor")
    with pytest.raises(PatchUnavailable, match="_init_executor is missing"):
        orphaned_processes.apply()


# --- in real processes (engine-marked: each starts an interpreter that imports vLLM) --------

_FAILED_START = """
import multiprocessing, sys
from vllm_deepinfer.patches import orphaned_processes

def serve(death_pipe, owners_end):
    owners_end.close()  # forked with both ends
    try:
        death_pipe.recv()  # as a vLLM worker: serves until its owner closes the pipe
    except EOFError:
        pass

class Executor:
    def _init_executor(self):
        reader, self.writer = multiprocessing.Pipe(duplex=False)
        self.worker = multiprocessing.get_context("fork").Process(target=serve, args=(reader, self.writer))
        self.worker.start()

    def shutdown(self):
        self.shutting_down = True
        self.writer.close()
        self.worker.join()
        print("workers stopped", flush=True)

if __name__ == "__main__":
    if {patched}:
        Executor._init_executor = orphaned_processes._wrap_init_executor(Executor._init_executor)
    executor = Executor()
    executor._init_executor()
    print("started", flush=True)
    raise SystemExit("the engine core failed to start")
"""


@pytest.mark.engine
@pytest.mark.parametrize("patched", [False, True])
def test_a_process_whose_start_failed_stops_its_workers_and_exits(patched, tmp_path):
    """Upstream's situation: the owner of a started executor fails, and multiprocessing's
    exit joins a worker that waits on the owner's death pipe. Unpatched it never exits."""
    script = tmp_path / "failed_start.py"
    script.write_text(textwrap.dedent(_FAILED_START).format(patched=patched))
    process = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout.readline() == "started\n", process.stderr.read()[-3000:]
    try:
        out, err = process.communicate(timeout=60 if patched else 5)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(process.pid).children(recursive=True):
            child.kill()
        process.kill()
        process.communicate()
        assert not patched, "the patched process did not exit"
        return
    assert patched, "the unpatched process exited: upstream no longer hangs here"
    assert process.returncode == 1 and "the engine core failed to start" in err
    assert out.splitlines() == ["workers stopped"]


_CHILD_OF_A_KILLED_PARENT = """
import multiprocessing, signal, sys, time
from vllm_deepinfer.patches import orphaned_processes

def engine_core(report):
    def on_sigterm(signum, frame):
        with open(report, "w") as out:
            out.write("stopped on SIGTERM")
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, on_sigterm)
    assert orphaned_processes.stop_when_parent_dies()
    print("watching", flush=True)
    time.sleep(120)

if __name__ == "__main__":
    child = multiprocessing.get_context("fork").Process(target=engine_core, args=(sys.argv[1],))
    child.start()
    print(child.pid, flush=True)
    time.sleep(120)
"""


@pytest.mark.engine
def test_an_engine_core_stops_once_its_parent_is_gone(tmp_path):
    script, report = tmp_path / "parent.py", tmp_path / "report"
    script.write_text(textwrap.dedent(_CHILD_OF_A_KILLED_PARENT))
    parent = subprocess.Popen(
        [sys.executable, str(script), str(report)], stdout=subprocess.PIPE, text=True
    )
    child_pid = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "watching"
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 60
    while psutil.pid_exists(child_pid) and time.monotonic() < deadline:
        try:
            if psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    assert report.read_text() == "stopped on SIGTERM"


@unit
def test_no_watch_outside_a_multiprocessing_child():
    assert orphaned_processes.stop_when_parent_dies() is False


@pytest.mark.engine
def test_an_engine_that_cannot_start_raises_instead_of_hanging(tiny_checkpoint):
    """vLLM's worker refuses a KV space larger than the machine: `LLM(...)` raises that
    error (upstream waited forever for the engine core, itself waiting for its worker)."""
    code = textwrap.dedent(
        f"""
        from vllm import LLM
        if __name__ == "__main__":
            try:
                LLM(model={tiny_checkpoint!r}, max_model_len=256, enforce_eager=True,
                    kv_cache_memory_bytes=1 << 50)
            except RuntimeError as exc:
                print("raised:", exc)
        """
    )
    # The engine in its own process, and the KV space as asked (the suite's setting wins).
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")
    }
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env
    )
    assert "raised: Engine core initialization failed" in run.stdout, run.stdout[-3000:]
    assert "less than requested memory for kv" in run.stdout + run.stderr
