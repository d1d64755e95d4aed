"""Prefix-cache savings as they are under bounded replay, on vLLM's Prometheus registry.

vLLM counts a prefix hit's tokens as cached before the scheduler rewinds the hit for
replay, so its hit counters include the `keep` tokens recomputed. These counters say what
was replayed and what was actually saved (hit minus replayed), per finished request:
without a KV connector (none runs on the CPU) every non-zero hit is longer than `keep`
(shorter ones are dropped) and replays exactly `keep`. vLLM's own counters are untouched.
"""

from __future__ import annotations

from prometheus_client import Counter
from vllm.v1.metrics.loggers import StatLoggerBase

PREFIX_REPLAYED_TOKENS = Counter(
    "deepinfer:prefix_replayed_tokens",
    "Prefix-cache hit tokens recomputed by bounded replay (vLLM counts them as cached).",
)
PREFIX_SAVED_TOKENS = Counter(
    "deepinfer:prefix_saved_tokens",
    "Prefix-cache hit tokens not recomputed: the hit minus its replayed tokens.",
)


class ReplayStatLogger(StatLoggerBase):
    """Counts (through plugins/stat_loggers.py), for each finished request, the
    replayed and saved tokens of its prefix hit; `keep`: the engine's replay length
    (model/deepseek_v41/registration.replay_keep)."""

    def __init__(self, keep: int):
        self.keep = keep

    def record(
        self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0
    ) -> None:
        if iteration_stats is None:
            return
        for finished in iteration_stats.finished_requests:
            hit = finished.num_cached_tokens
            replayed = min(hit, self.keep)
            PREFIX_REPLAYED_TOKENS.inc(replayed)
            PREFIX_SAVED_TOKENS.inc(hit - replayed)

    def log_engine_initialized(self) -> None:
        pass
