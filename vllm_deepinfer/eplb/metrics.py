"""`moe_lb` (busiest EP rank's MoE load / mean) of the steps vLLM's EPLB logs, per layer and
overall, from the workers to the balancedness log line and `/metrics`.

While `--eplb-config` has `log_balancedness` on, vLLM's EPLB state records every step's
expert load and logs "balancedness" (mean / max, all layers summed) every
`log_balancedness_interval` steps. At those steps every EP rank here sums the step's
per-physical-expert load over the EP group (the same steps on every rank: one
collective each), rank 0 logs `moe_lb` beside vLLM's line, and every worker attaches the
figures to its step's output. The plugin's scheduler (`MoeBalanceScheduler`) carries them
into the step's scheduler stats (`SchedulerStats.deepinfer_moe_lb`, declared by
patches/eplb_stats.py) and the stat logger sets the gauges. With `DEEPINFER_EPLB_TRACE`,
rank 0 also records those steps' loads per logical expert (a routing trace for
`benchmarks/eplb.py --trace`)."""

from __future__ import annotations

import atexit
import functools

import numpy as np
import torch
from prometheus_client import Gauge
from vllm.distributed import get_ep_group
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_deepinfer import envs
from vllm_deepinfer.eplb.balance import moe_lb, overall_moe_lb
from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)

RUNNER_OUTPUT_ATTR = "deepinfer_moe_lb"
STATS_FIELD = "deepinfer_moe_lb"
"""[overall, layer 0, layer 1, ...] on the runner's output and in the scheduler stats."""

MOE_LB = Gauge(
    "deepinfer:moe_lb",
    "Busiest expert-parallel rank's MoE load over the mean "
    "rank load, last logged EPLB step, per MoE layer.",
    labelnames=("engine", "layer"),
    multiprocess_mode="mostrecent",
)
MOE_LB_OVERALL = Gauge(
    "deepinfer:moe_lb_overall",
    "moe_lb of all MoE layers together "
    "(sum of busiest-rank loads over sum of mean loads), last logged "
    "EPLB step.",
    labelnames=("engine",),
    multiprocess_mode="mostrecent",
)


class TraceRecorder:
    """The routing trace `DEEPINFER_EPLB_TRACE` asks for: each logged step's load per
    logical expert and layer, written to the file every TRACE_FLUSH_STEPS steps and when
    the process exits."""

    def __init__(self, path: str):
        self.path = path
        self.steps: list[np.ndarray] = []
        atexit.register(self.flush)

    def add(self, logical_load: torch.Tensor) -> None:
        self.steps.append(logical_load.numpy().astype(np.int64))
        if len(self.steps) % TRACE_FLUSH_STEPS == 0:
            self.flush()

    def flush(self) -> None:
        if self.steps:
            np.save(self.path, np.stack(self.steps))


TRACE_FLUSH_STEPS = 64


@functools.cache
def _trace_recorder() -> TraceRecorder | None:
    """The recorder `DEEPINFER_EPLB_TRACE` asks for (read once per process)."""
    path = envs.load().eplb_trace
    return None if path is None else TraceRecorder(path)


def _record_trace(model_state, load: torch.Tensor) -> None:
    """On EP rank 0, when asked: this step's load summed per logical expert."""
    recorder = _trace_recorder()
    if recorder is None:
        return
    placement = model_state.physical_to_logical_map[:, : load.shape[1]].long()
    logical = torch.zeros(
        load.shape[0], model_state.model.num_logical_experts, dtype=load.dtype
    ).scatter_add_(1, placement, load)
    recorder.add(logical)


def step_moe_lb(eplb_state, model_config, is_dummy: bool) -> list[float] | None:
    """[overall, per layer...] of this step's load over the EP group, at the steps vLLM's
    EPLB state logs balancedness (call before its `step`, which clears the load; a dummy
    step counts no load, as there); None at other steps. A collective: every EP rank
    calls it every step."""
    config = eplb_state.parallel_config.eplb_config
    if not config.log_balancedness or (
        eplb_state.expert_rearrangement_step % config.log_balancedness_interval
    ):
        return None
    model_state = eplb_state.model_states[model_config.compute_hash()]
    group = get_ep_group()
    load = model_state.expert_load_pass.clone()
    if is_dummy:
        load.zero_()
    torch.distributed.all_reduce(load, group=group.device_group)
    per_rank = load.reshape(load.shape[0], group.world_size, -1).sum(-1).double().numpy()
    figures = [overall_moe_lb(per_rank), *moe_lb(per_rank).tolist()]
    if group.rank_in_group == 0 and per_rank.sum() > 0:
        _record_trace(model_state, load)
        logger.info(
            "EPLB step %d: moe_lb=%.4f (busiest rank / mean), per layer %s",
            eplb_state.expert_rearrangement_step,
            figures[0],
            np.array2string(np.asarray(figures[1:]), precision=3),
        )
    return figures


def attach(output, figures: list[float] | None):
    """Puts `figures` on the runner's step output (or on the output an asynchronous step
    resolves to)."""
    if figures is None:
        return output
    if hasattr(output, "get_output"):  # async scheduling: the output arrives later
        resolve = output.get_output

        def get_output():
            resolved = resolve()
            setattr(resolved, RUNNER_OUTPUT_ATTR, figures)
            return resolved

        output.get_output = get_output
    elif output is not None:
        setattr(output, RUNNER_OUTPUT_ATTR, figures)
    return output


class MoeBalanceScheduler(Scheduler):
    """vLLM's scheduler, carrying the workers' `moe_lb` into the step's stats (the next
    stats it sends, when a step sends none)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._moe_lb: list[float] | None = None

    def update_from_output(self, scheduler_output, model_runner_output):
        figures = getattr(model_runner_output, RUNNER_OUTPUT_ATTR, None)
        if figures is not None:
            self._moe_lb = figures
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._moe_lb is not None:
            for engine_outputs in outputs.values():
                if engine_outputs.scheduler_stats is not None:
                    setattr(engine_outputs.scheduler_stats, STATS_FIELD, self._moe_lb)
                    self._moe_lb = None
                    break
        return outputs


class MoeBalanceStatLogger(StatLoggerBase):
    """Sets the `moe_lb` gauges from each engine's stats (plugins/stat_loggers.py)."""

    def __init__(self, vllm_config, engine_index: int = 0):
        pass

    def record(
        self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0
    ) -> None:
        figures = getattr(scheduler_stats, STATS_FIELD, None)
        if not figures:
            return
        engine = str(engine_idx)
        MOE_LB_OVERALL.labels(engine=engine).set(figures[0])
        for layer, value in enumerate(figures[1:]):
            MOE_LB.labels(engine=engine, layer=str(layer)).set(value)

    def log_engine_initialized(self) -> None:
        pass
