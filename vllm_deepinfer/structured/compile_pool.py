"""Grammar compilation away from inference: worker processes run vLLM's own xgrammar
backend (so they compile exactly what the engine would) with the shared on-disk cache in
front of its compiler. A request is submitted to the engine only once its grammar is in
the cache; a slow or failing compile holds up or fails that request alone. A worker that
dies (killed, out of memory) is replaced and what it was compiling is compiled again.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time
from concurrent.futures import Future, InvalidStateError, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from vllm.sampling_params import StructuredOutputsParams

from vllm_deepinfer import process_exit
from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.structured.grammar_cache import STATS_ATTRIBUTE, cache_compilers

logger = init_logger(__name__)
WORKER_TITLE = "DeepInferGrammarCompile"
"""The workers' process title (under vLLM's prefix: `VLLM::DeepInferGrammarCompile`)."""
_worker_backend = None


@dataclass(frozen=True)
class CompileResult:
    cached: bool
    """Served from the cache: this constraint was compiled before."""
    seconds: float


def xgrammar_backend(vllm_config):
    """vLLM's xgrammar backend as the engine makes it: the model's tokenizer and vocabulary
    size, the engine's structured-outputs config."""
    from vllm.tokenizers import cached_tokenizer_from_config
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    model_config = vllm_config.model_config
    return XgrammarBackend(
        vllm_config,
        tokenizer=cached_tokenizer_from_config(model_config),
        vocab_size=model_config.get_vocab_size(),
    )


def _init_worker(vllm_config, cache_dir: str) -> None:
    global _worker_backend
    # Ctrl-C reaches every process of the server's group; the front end stops this pool
    # itself after the engine, so a worker must not die of it (traceback, broken pool).
    # The worker started with SIGINT blocked (`_submit`): one that came while it was
    # starting is dropped here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    from vllm.utils.system_utils import set_process_title

    set_process_title(WORKER_TITLE)  # `ps` tells it from the engine core (also spawned)
    # The pool is only started where the grammar-cache patch applies (the front end
    # checks), so the engine reads what this backend's compilers store in the cache.
    backend = xgrammar_backend(vllm_config)
    if not hasattr(backend, STATS_ATTRIBUTE):  # the patch is not applied in this process
        setattr(backend, STATS_ATTRIBUTE, cache_compilers(backend, cache_dir))
    _worker_backend = backend
    _leave_quickly()


def _leave_quickly() -> None:
    """A pool worker's exit (status 0 however its pool ends it) skips the interpreter's
    final scan of the compiler's large heap, which took seconds under load while the
    pool's shutdown waited (process_exit). Armed again after each compile, so that it
    follows any exit handler the compiler registered."""
    process_exit.leave_after_exit_handlers(0)


def _compile(params: StructuredOutputsParams) -> CompileResult:
    from vllm.v1.structured_output.request import get_structured_output_key

    request_type, spec = get_structured_output_key(params)
    if _worker_backend is None:
        raise RuntimeError("a grammar compile worker ran a task before its initializer")
    stats = getattr(_worker_backend, STATS_ATTRIBUTE)  # all its compilers, whichever compiles
    hits_before = stats.hits
    start = time.perf_counter()
    _worker_backend.compile_grammar(request_type, spec)
    _leave_quickly()
    return CompileResult(cached=stats.hits > hits_before, seconds=time.perf_counter() - start)


class GrammarCompilePool:
    """Compiles in `workers` spawned processes. A worker that dies breaks its executor
    (every compile it held fails with BrokenProcessPool): the pool starts a new executor
    and submits those compiles again, each once (a constraint whose compile kills the
    worker a second time fails its own request)."""

    def __init__(self, vllm_config, cache_dir: str, workers: int = 1):
        self._initargs = (vllm_config, cache_dir)
        self._workers = workers
        self._lock = threading.Lock()
        self._closed = False
        self._executor = self._new_executor()
        self._ready: set = set()

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=self._workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=self._initargs,
        )

    def compile(self, params: StructuredOutputsParams) -> Future:
        """Future[CompileResult]; raises the compile error for a bad constraint. A constraint
        this pool has already made ready is answered at once, without a worker round trip."""
        from vllm.v1.structured_output.request import get_structured_output_key

        key = get_structured_output_key(params)
        result: Future = Future()
        if key in self._ready:
            result.set_result(CompileResult(cached=True, seconds=0.0))
            return result

        def remember(done: Future) -> None:
            if not done.cancelled() and done.exception() is None:
                self._ready.add(key)

        result.add_done_callback(remember)
        self._submit(params, result, retries=1)
        return result

    def _submit(self, params: StructuredOutputsParams, result: Future, retries: int) -> None:
        with self._lock:
            executor = self._executor
        # A submit may start the worker process: it inherits SIGINT blocked, so a Ctrl-C
        # during its start-up cannot kill it before `_init_worker` ignores SIGINT.
        previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            attempt = executor.submit(_compile, params)
        except Exception as e:  # noqa: BLE001 - broken or shut down: settled below
            attempt = Future()
            attempt.set_exception(e)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        # The caller giving up (a client gone) withdraws a compile not yet started.
        result.add_done_callback(lambda f: f.cancelled() and attempt.cancel())
        attempt.add_done_callback(
            lambda done: self._settle(done, executor, params, result, retries)
        )

    def _settle(
        self,
        attempt: Future,
        executor: ProcessPoolExecutor,
        params: StructuredOutputsParams,
        result: Future,
        retries: int,
    ) -> None:
        """`attempt`'s outcome is the result's, unless its executor broke under it: then
        it is compiled again on a new one."""
        if result.done():  # cancelled by the caller
            return
        if attempt.cancelled():  # the pool shut down
            result.cancel()
            return
        error = attempt.exception()
        if isinstance(error, BrokenProcessPool) and retries and self._replace(executor):
            self._submit(params, result, retries - 1)
            return
        try:
            if error is None:
                result.set_result(attempt.result())
            else:
                result.set_exception(error)
        except InvalidStateError:  # cancelled meanwhile
            pass

    def _replace(self, broken: ProcessPoolExecutor) -> bool:
        """Puts a new executor in place of `broken` (once, whichever compile notices first);
        False once the pool is shut down."""
        with self._lock:
            if self._closed:
                return False
            if self._executor is broken:
                logger.warning(
                    "grammar compile pool: a worker process died; starting a new "
                    "one and compiling again what it had"
                )
                self._executor = self._new_executor()
        return True

    def compile_all(self, params: list) -> list[CompileResult | None]:
        """Compiles the grammars of a batch of SamplingParams before it is submitted."""
        futures = [
            self.compile(p.structured_outputs) if p.structured_outputs else None for p in params
        ]
        return [f.result() if f else None for f in futures]

    def shutdown(self) -> None:
        """Cancels what is queued and returns once the workers have exited (so their
        queues' semaphores are released, not left to the resource tracker)."""
        with self._lock:
            self._closed = True
            executor = self._executor
        executor.shutdown(wait=True, cancel_futures=True)
