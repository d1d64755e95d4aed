"""Prometheus metrics of grammar compilation, served on vLLM's /metrics."""

from prometheus_client import Counter, Histogram

GRAMMAR_COMPILE_SECONDS = Histogram(
    "deepinfer:grammar_compile_seconds",
    "Time to make a request's grammar ready outside the engine (compile or cache load).",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0),
)
GRAMMAR_CACHE_HITS = Counter(
    "deepinfer:grammar_cache_hits", "Grammars served from the compiled-grammar cache."
)
GRAMMAR_COMPILES = Counter("deepinfer:grammar_compiles", "Grammars compiled (cache misses).")


def record(result) -> None:
    GRAMMAR_COMPILE_SECONDS.observe(result.seconds)
    (GRAMMAR_CACHE_HITS if result.cached else GRAMMAR_COMPILES).inc()
