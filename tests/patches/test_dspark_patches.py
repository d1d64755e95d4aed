"""The two DSpark patches: V1 accepts DSpark for the plugin's V4.1, and
DSpark's counts survive the engine core's typed output encoding."""

import pytest

from vllm_deepinfer.model.deepseek_v41.registration import DSPARK_PROPOSER

pytestmark = pytest.mark.unit


def engine_config(model, **options):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=model, dtype="float32", max_model_len=512, enforce_eager=True, **options
    ).create_engine_config()


@pytest.mark.model_runner_v1
@pytest.mark.engine_config
def test_v1_serves_dspark_for_the_plugins_v41(tiny_checkpoint):
    config = engine_config(
        tiny_checkpoint,
        speculative_config={
            "method": "dspark",
            "num_speculative_tokens": 5,
            "enable_adaptive_verification": True,
        },
    )
    assert config.speculative_config.method == "dspark"
    assert config.scheduler_config.scheduler_cls.endswith("DSparkScheduler")
    assert config.parallel_config.worker_cls.endswith("DeepInferCPUWorker")
    custom = engine_config(
        tiny_checkpoint,
        speculative_config={
            "method": "custom_class",
            "model": DSPARK_PROPOSER,
            "num_speculative_tokens": 3,
        },
    )
    assert custom.scheduler_config.scheduler_cls.endswith("DSparkScheduler")


@pytest.mark.model_runner_v1
@pytest.mark.engine_config
@pytest.mark.parametrize("asked", [None, 32])
def test_dspark_runs_as_many_requests_as_asked(tiny_checkpoint, asked):
    """vLLM 0.33 lowers DSpark's max_num_active_seqs to max_num_batched_tokens //
    num_lookahead_tokens for Model Runner V2's draft pass (here 64 // 5: 12 of 32); the
    plugin's stages draft outside the step's budget on V1, so the user's value stays."""
    config = engine_config(
        tiny_checkpoint,
        max_num_seqs=32,
        max_num_batched_tokens=64,
        max_num_active_seqs=asked,
        speculative_config={"method": "dspark", "num_speculative_tokens": 5},
    )
    assert config.scheduler_config.max_num_active_seqs == asked


def test_dspark_counts_survive_the_engine_outputs_encoding():
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_deepinfer import patches
    from vllm_deepinfer.spec_decode.dspark.stats import STATS_FIELD, DraftCounters, DraftGauges

    # Both stats fields first, as register() declares them before vLLM encodes anything:
    # msgspec keeps the fields SchedulerStats had when the outputs' type was first encoded.
    assert patches.apply_patch("dspark_stats") and patches.apply_patch("eplb_stats")
    stats = SchedulerStats()  # a step that verified no draft: no spec_decoding_stats
    counts = DraftCounters(
        proposed=10,
        calibrated=4,
        confidence_sum=2.5,
        accepted=3,
        decode_steps=7,
        skipped_steps=5,
        request_steps=40,
        gauges=DraftGauges(
            ece_raw=0.2,
            ece_calibrated=0.03,
            predicted_per_pos=[0.7, 0.6],
            observed_per_pos=[0.68, 0.61],
            cost_fit_r2=0.9,
        ),
    )
    setattr(stats, STATS_FIELD, counts)
    outputs = EngineCoreOutputs(outputs=[], scheduler_stats=stats)
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    assert getattr(decoded.scheduler_stats, STATS_FIELD) == counts
    plain = EngineCoreOutputs(outputs=[], scheduler_stats=SchedulerStats())
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(plain))
    assert getattr(decoded.scheduler_stats, STATS_FIELD) is None
