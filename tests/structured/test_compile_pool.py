"""The compile pool's recovery from a dead worker, on stand-in executors (the real kill is
tests/serving/test_faults.py): a broken executor is replaced once, whichever compile
notices first, and the compiles it held are submitted again, each once, so a constraint
that kills its worker every time fails its own request instead of looping; a pool that is
shut down starts nothing."""

from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import pytest
from vllm.sampling_params import StructuredOutputsParams

from helpers import logged_records
from vllm_deepinfer.structured import compile_pool
from vllm_deepinfer.structured.compile_pool import CompileResult, GrammarCompilePool

pytestmark = pytest.mark.unit
DONE = CompileResult(cached=False, seconds=0.0)


class Executor:
    """Answers every compile, or fails all it holds with BrokenProcessPool at `break_()`
    and refuses new ones, as a ProcessPoolExecutor whose worker died."""

    def __init__(self):
        self.held: list[Future] = []
        self.broken = False

    def submit(self, fn, *args):
        if self.broken:
            raise BrokenProcessPool("a child process terminated abruptly")
        future = Future()
        self.held.append(future)
        return future

    def break_(self):
        self.broken = True
        for future in self.held:
            future.set_exception(BrokenProcessPool("terminated abruptly"))

    def shutdown(self, wait, cancel_futures):
        pass


@pytest.fixture
def pool(monkeypatch):
    executors: list[Executor] = []

    def new_executor(self):
        executors.append(Executor())
        return executors[-1]

    monkeypatch.setattr(GrammarCompilePool, "_new_executor", new_executor)
    pool = GrammarCompilePool(vllm_config=None, cache_dir="unused")
    pool.executors = executors
    return pool


def _regex(pattern: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=pattern)


def test_compiles_held_by_a_dead_worker_are_compiled_again(pool):
    first, second = pool.compile(_regex("a")), pool.compile(_regex("b"))
    with logged_records(compile_pool.logger) as records:
        pool.executors[0].break_()
    assert len(pool.executors) == 2 and len(records) == 1  # replaced once, for both
    for future in pool.executors[1].held:
        future.set_result(DONE)
    assert first.result(timeout=0) == second.result(timeout=0) == DONE


def test_a_worker_found_dead_at_submit_is_replaced(pool):
    pool.executors[0].break_()  # died while idle
    future = pool.compile(_regex("a"))
    pool.executors[1].held[0].set_result(DONE)
    assert future.result(timeout=0) == DONE


def test_a_compile_that_kills_its_worker_twice_fails_its_request(pool):
    future = pool.compile(_regex("a"))
    pool.executors[0].break_()
    pool.executors[1].break_()
    with pytest.raises(BrokenProcessPool):
        future.result(timeout=0)
    later = pool.compile(_regex("b"))  # the next request gets a new worker
    pool.executors[2].held[0].set_result(DONE)
    assert later.result(timeout=0) == DONE


def test_a_pool_shut_down_starts_no_worker(pool):
    future = pool.compile(_regex("a"))
    pool.shutdown()
    pool.executors[0].break_()
    assert len(pool.executors) == 1
    with pytest.raises(BrokenProcessPool):
        future.result(timeout=0)
