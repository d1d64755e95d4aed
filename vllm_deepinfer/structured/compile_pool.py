"""Grammar compilation away from inference: worker processes run vLLM's own xgrammar
backend (so they compile exactly what the engine would) with the shared on-disk cache in
front of its compiler. A request is submitted to the engine only once its grammar is in
the cache; a slow or failing compile holds up or fails that request alone.
"""
from __future__ import annotations

import multiprocessing
import signal
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

from vllm.sampling_params import StructuredOutputsParams

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
    return XgrammarBackend(vllm_config, tokenizer=cached_tokenizer_from_config(model_config),
                           vocab_size=model_config.get_vocab_size())


def _init_worker(vllm_config, cache_dir: str) -> None:
    global _worker_backend
    # Ctrl-C reaches every process of the server's group; the front end stops this pool
    # itself after the engine, so a worker must not die of it (traceback, broken pool).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from vllm_deepinfer.patches import apply_patch

    # The pool is only started where the patch applies (the front end checks), so the
    # backend below stores what it compiles in the shared cache.
    apply_patch("xgrammar_grammar_cache", cache_dir=cache_dir)
    _worker_backend = xgrammar_backend(vllm_config)


def _compile(params: StructuredOutputsParams) -> CompileResult:
    from vllm.v1.structured_output.request import get_structured_output_key

    request_type, spec = get_structured_output_key(params)
    stats = _worker_backend.compiler.stats
    hits_before = stats.hits
    start = time.perf_counter()
    _worker_backend.compile_grammar(request_type, spec)
    return CompileResult(cached=stats.hits > hits_before, seconds=time.perf_counter() - start)


class GrammarCompilePool:
    def __init__(self, vllm_config, cache_dir: str, workers: int = 1):
        self._executor = ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker, initargs=(vllm_config, cache_dir))
        self._ready: set = set()

    def compile(self, params: StructuredOutputsParams) -> Future:
        """Future[CompileResult]; raises the compile error for a bad constraint. A constraint
        this pool has already made ready is answered at once, without a worker round trip."""
        from vllm.v1.structured_output.request import get_structured_output_key

        key = get_structured_output_key(params)
        if key in self._ready:
            known: Future = Future()
            known.set_result(CompileResult(cached=True, seconds=0.0))
            return known
        future = self._executor.submit(_compile, params)
        future.add_done_callback(lambda f: f.exception() or self._ready.add(key))
        return future

    def compile_all(self, params: list) -> list[CompileResult | None]:
        """Compiles the grammars of a batch of SamplingParams before it is submitted."""
        futures = [self.compile(p.structured_outputs) if p.structured_outputs else None
                   for p in params]
        return [f.result() if f else None for f in futures]

    def shutdown(self) -> None:
        """Cancels what is queued and returns once the workers have exited (so their
        queues' semaphores are released, not left to the resource tracker)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
