"""Feeds each step's scheduler output to the engine's replay tracker
(kv_cache/bounded_replay.py) before the runner builds the step: vLLM's scheduler decides
where each request's replay starts, but its V1 runner passes that to no model."""

from __future__ import annotations

import contextlib

from vllm_deepinfer.kv_cache.bounded_replay import tracker_for


@contextlib.contextmanager
def step(vllm_config, scheduler_output, runner):
    """The tracker knows this step's admissions and replay starts while the runner runs
    it, and forgets the runner after."""
    tracker = tracker_for(vllm_config)
    tracker.begin_step(scheduler_output, runner)
    try:
        yield
    finally:
        tracker.end_step()


def check_runner(runner) -> None:
    """Refuses, at start, a runner whose persistent batch the tracker cannot read (Model
    Runner V2 has none) when the model will replay; the alternative is a failure at the
    first replayed step."""
    from vllm_deepinfer import envs

    if envs.load().yoco_prefill_keep_tokens and not _has_persistent_batch(runner):
        raise envs.ConfigError(
            f"bounded replay reads Model Runner V1's persistent batch, which "
            f"{type(runner).__name__} does not have: run vLLM's V1 runner "
            f"(VLLM_USE_V2_MODEL_RUNNER=0) or exact mode (DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=0)"
        )


def _has_persistent_batch(runner) -> bool:
    batch = getattr(runner, "input_batch", None)
    return hasattr(batch, "req_ids") and hasattr(batch, "token_ids_cpu")


def stats(vllm_config) -> dict:
    return tracker_for(vllm_config).stats()
