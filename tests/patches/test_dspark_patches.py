"""The two DSpark patches: V1 accepts DSpark for the plugin's V4.1, and
DSpark's counts survive the engine core's typed output encoding."""
import pytest
from vllm_deepinfer.model.deepseek_v41.registration import DSPARK_PROPOSER

pytestmark = pytest.mark.unit


def engine_config(model, **options):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, dtype="float32", max_model_len=512, enforce_eager=True,
                      **options).create_engine_config()


def test_v1_serves_dspark_for_the_plugins_v41(tiny_checkpoint):
    config = engine_config(tiny_checkpoint, speculative_config={
        "method": "dspark", "num_speculative_tokens": 5, "enable_adaptive_verification": True})
    assert config.speculative_config.method == "dspark"
    assert config.scheduler_config.scheduler_cls.endswith("DSparkScheduler")
    assert config.parallel_config.worker_cls.endswith("DeepInferCPUWorker")
    custom = engine_config(tiny_checkpoint, speculative_config={
        "method": "custom_class", "model": DSPARK_PROPOSER, "num_speculative_tokens": 3})
    assert custom.scheduler_config.scheduler_cls.endswith("DSparkScheduler")


def test_dspark_counts_survive_the_engine_outputs_encoding():
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    from vllm_deepinfer import patches
    from vllm_deepinfer.spec_decode.dspark.stats import DraftCounters, DSparkDecodingStats

    assert patches.apply_patch("dspark_stats")
    stats = DSparkDecodingStats.extended(SpecDecodingStats.new(5), DraftCounters(
        proposed=10, calibrated=4, confidence_sum=2.5, accepted=3))
    outputs = EngineCoreOutputs(outputs=[], scheduler_stats=SchedulerStats(
        spec_decoding_stats=stats))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    got = decoded.scheduler_stats.spec_decoding_stats
    assert (got.num_proposed_tokens, got.num_calibrated_drafts, got.confidence_sum,
            got.num_calibrated_accepted) == (10, 4, 2.5, 3)
    plain = EngineCoreOutputs(outputs=[], scheduler_stats=SchedulerStats(
        spec_decoding_stats=SpecDecodingStats.new(5)))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(plain))
    assert decoded.scheduler_stats.spec_decoding_stats.num_proposed_tokens == 0
