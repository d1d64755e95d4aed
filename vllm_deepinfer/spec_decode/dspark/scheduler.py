"""vLLM's scheduler, carrying the DSpark proposer's counts into each step's stats (and,
as every plugin scheduler, EPLB's `moe_lb`: eplb/metrics.py).

Selected through vLLM's `scheduler_cls` (the plugin's CPU platform config sets it when
speculative decoding uses the DSpark stages and the user left it unset).
"""

from __future__ import annotations

from vllm_deepinfer.eplb.metrics import MoeBalanceScheduler
from vllm_deepinfer.spec_decode.dspark.stats import RUNNER_OUTPUT_ATTR, STATS_FIELD, DraftCounters


class DSparkScheduler(MoeBalanceScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending = DraftCounters()  # counts waiting for a step that reports stats

    def update_from_output(self, scheduler_output, model_runner_output):
        counters = getattr(model_runner_output, RUNNER_OUTPUT_ATTR, None)
        if counters:
            self._pending.add(counters)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._pending:
            for engine_outputs in outputs.values():
                stats = engine_outputs.scheduler_stats
                if stats is not None:
                    setattr(stats, STATS_FIELD, self._pending)
                    self._pending = DraftCounters()
                    break
        return outputs
