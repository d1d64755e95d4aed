"""EPLB and `moe_lb` on vLLM's V1 runners. vLLM's CPU model runner loads the model without
an EPLB state (its GPU runner creates the state and registers the model in `load_model`),
and vLLM's gloo communicator for moving experts synchronises an accelerator stream: here
the state is started for a CPU runner; everything after (the per-step window,
rearrangement, the balancedness log) is the GPU runner's code, which the CPU runner
inherits. On either runner each EPLB step measures `moe_lb` (eplb/metrics.py)."""

from __future__ import annotations

from vllm.distributed import get_ep_group
from vllm.distributed.eplb.eplb_state import EplbState
from vllm.model_executor.models.interfaces import get_mixture_of_experts_model

from vllm_deepinfer.eplb import metrics as moe_balance
from vllm_deepinfer.eplb.communicator import CpuGlooEplbCommunicator
from vllm_deepinfer.eplb.metrics import RUNNER_OUTPUT_ATTR, step_moe_lb
from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)


def attach(runner) -> None:
    """Registers the runner's mixture-of-experts model with a new EPLB state where the
    runner made none, as vLLM's GPU runner does after loading (EPLB rearranges
    synchronously here), and measures `moe_lb` at the steps vLLM logs balancedness."""
    if getattr(runner, "eplb_state", None) is not None:  # vLLM's GPU runner
        _measure_moe_lb_each_step(runner, runner.eplb_state)
        return
    model = get_mixture_of_experts_model(runner.model)
    if model is None:
        raise ValueError(
            f"--enable-eplb: {type(runner.model).__name__} is not a "
            "mixture-of-experts model vLLM's EPLB can balance"
        )
    state = EplbState(runner.parallel_config, runner.device)
    state.add_model(model, runner.model_config)
    if runner.device.type == "cpu":  # vLLM's gloo communicator needs an accelerator
        state.update_communicator(
            runner.model_config, CpuGlooEplbCommunicator(get_ep_group().cpu_group)
        )
    runner.eplb_state, runner._moe_model = state, model
    _measure_moe_lb_each_step(runner, state)
    logger.info(
        "EPLB on for %s: %d MoE layers, %d logical experts, %d physical (%d per rank)",
        runner.model_config.model,
        model.num_moe_layers,
        model.num_logical_experts,
        model.num_physical_experts,
        model.num_local_physical_experts,
    )


def _measure_moe_lb_each_step(runner, state) -> None:
    """Before each EPLB step, the step's `moe_lb` (eplb/metrics.py), left on the runner
    for the worker to attach to the step's output."""
    step = runner.eplb_step

    def eplb_step(is_dummy: bool = False, is_profile: bool = False) -> None:
        if not is_profile and not getattr(runner, "eep_eplb_suppressed", False):
            setattr(runner, RUNNER_OUTPUT_ATTR, step_moe_lb(state, runner.model_config, is_dummy))
        step(is_dummy, is_profile)

    runner.eplb_step = eplb_step


def attach_step_balance(output, runner):
    """The step's `moe_lb`, left on the runner by the EPLB step, onto the step's output
    (for the scheduler's stats); outputs of steps that measured none pass unchanged."""
    return moe_balance.attach(output, runner.__dict__.pop(RUNNER_OUTPUT_ATTR, None))
