"""The plugin's metrics in `LLM.get_metrics()`, as they are on `/metrics`.

Why: vLLM loads `vllm.stat_logger_plugins` only in `AsyncLLM` (the server); the offline
`LLMEngine` takes stat loggers but `LLM` never passes any, so the plugin's replay counters
(kv_cache/replay_metrics.py) would never count offline. And `get_metrics_snapshot`, which
`LLMEngine.get_metrics` returns, keeps only `vllm:` names, so no `deepinfer:` metric
reaches `LLM.get_metrics()` even where it counts.

How: `LLMEngine.__init__` gets the plugin stat loggers when stats are on and the caller
passed none (as `AsyncLLM` does); `LLMEngine.get_metrics` appends the registry's
`deepinfer:` counters, gauges and histograms, in the reader's own types.

Upstream symbols: vllm.v1.engine.llm_engine.LLMEngine.__init__ (its `stat_loggers`
parameter) and LLMEngine.get_metrics. Remove when LLMEngine loads stat logger plugins and
the snapshot keeps other prefixes (or takes one).
"""

from __future__ import annotations

import functools

from vllm_deepinfer.patches.base import PatchUnavailable, parameter_names, source_of

UPSTREAM = (
    "vllm.v1.engine.llm_engine.LLMEngine.__init__, vllm.v1.engine.llm_engine.LLMEngine.get_metrics"
)
PREFIX = "deepinfer:"
_MARK = "_deepinfer_offline_metrics"


def check_upstream():
    try:
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.metrics import reader
        from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories
    except ImportError as exc:
        raise PatchUnavailable(f"vLLM's offline engine or metrics reader moved ({exc})") from exc
    if not callable(getattr(LLMEngine, "get_metrics", None)):
        raise PatchUnavailable("LLMEngine.get_metrics is missing")
    if "stat_loggers" not in parameter_names(LLMEngine.__init__):
        raise PatchUnavailable("LLMEngine.__init__ no longer takes stat_loggers")
    if "vllm:" not in source_of(reader.get_metrics_snapshot, "get_metrics_snapshot"):
        raise PatchUnavailable("get_metrics_snapshot no longer filters by the vllm: prefix")
    if "load_stat_logger_plugin_factories" in source_of(LLMEngine.__init__, "LLMEngine.__init__"):
        return None  # upstream loads the plugins itself
    return LLMEngine, reader, load_stat_logger_plugin_factories


def apply() -> bool:
    found = check_upstream()
    if found is None:
        return False
    LLMEngine, reader, load_factories = found
    if getattr(LLMEngine.__init__, _MARK, False):
        return True
    init, get_metrics = LLMEngine.__init__, LLMEngine.get_metrics

    @functools.wraps(init)
    def __init__(self, *args, stat_loggers=None, **kwargs):
        if not stat_loggers:
            stat_loggers = load_factories() or None
        init(self, *args, stat_loggers=stat_loggers, **kwargs)

    @functools.wraps(get_metrics)
    def get_metrics_with_plugin(self):
        return get_metrics(self) + plugin_metrics(reader)

    setattr(__init__, _MARK, True)
    LLMEngine.__init__, LLMEngine.get_metrics = __init__, get_metrics_with_plugin
    return True


def plugin_metrics(reader) -> list:
    """The registry's `deepinfer:` metrics as the reader's Counter/Gauge/Histogram."""
    collected = []
    for metric in reader.REGISTRY.collect():
        if not metric.name.startswith(PREFIX):
            continue

        def named(suffix: str, metric=metric) -> list:
            return [s for s in metric.samples if s.name == metric.name + suffix]

        if metric.type == "counter":
            # Sums of probabilities (DSpark's confidences) are not whole numbers.
            collected += [
                reader.Counter(
                    metric.name, s.labels, int(s.value) if float(s.value).is_integer() else s.value
                )
                for s in named("_total")
            ]
        elif metric.type == "gauge":
            collected += [reader.Gauge(metric.name, s.labels, s.value) for s in named("")]
        elif metric.type == "histogram":
            for count, total in zip(named("_count"), named("_sum")):
                buckets = {
                    s.labels["le"]: int(s.value)
                    for s in named("_bucket")
                    if {k: v for k, v in s.labels.items() if k != "le"} == count.labels
                }
                collected.append(
                    reader.Histogram(
                        metric.name, count.labels, int(count.value), total.value, buckets
                    )
                )
    return collected
