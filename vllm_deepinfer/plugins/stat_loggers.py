"""The `vllm.stat_logger_plugins` entry point `deepinfer`: one logger that hands vLLM's
stats to each of the plugin's counters (vLLM loads plugins by entry-point name, so under
`VLLM_PLUGINS=deepinfer` only an entry named `deepinfer` is loaded)."""

from __future__ import annotations

from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_deepinfer.eplb.metrics import MoeBalanceStatLogger
from vllm_deepinfer.kv_cache.replay_metrics import ReplayStatLogger
from vllm_deepinfer.model.deepseek_v41.registration import replay_keep
from vllm_deepinfer.spec_decode.dspark.metrics import DSparkStatLogger


class DeepInferStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0):
        self.loggers = [
            ReplayStatLogger(replay_keep(vllm_config)),
            DSparkStatLogger(vllm_config, engine_index),
            MoeBalanceStatLogger(vllm_config, engine_index),
        ]

    def record(
        self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0
    ) -> None:
        for logger in self.loggers:
            logger.record(scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)

    def log_engine_initialized(self) -> None:
        for logger in self.loggers:
            logger.log_engine_initialized()
