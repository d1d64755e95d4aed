"""The worker package's composition, for the CPU and the GPU worker alike (the engine tests
run the CPU one; no GPU runs here)."""

from types import SimpleNamespace

import pytest

from helpers import without_model_runner_v1

if without_model_runner_v1():  # the workers compose Model Runner V1's parts
    pytest.skip(without_model_runner_v1(), allow_module_level=True)

from vllm_deepinfer import envs  # noqa: E402
from vllm_deepinfer.worker import dspark_runner, replay_feed  # noqa: E402
from vllm_deepinfer.worker.cpu_worker import DeepInferCPUWorker  # noqa: E402
from vllm_deepinfer.worker.gpu_worker import DeepInferGPUWorker  # noqa: E402
from vllm_deepinfer.worker.worker_base import DeepInferWorkerMixin  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("worker", [DeepInferCPUWorker, DeepInferGPUWorker])
def test_both_workers_compose_the_features_over_vllms_worker(worker):
    from vllm.v1.worker.gpu_worker import Worker

    mro = worker.__mro__
    assert mro[1] is DeepInferWorkerMixin and issubclass(worker, Worker)
    assert worker.feeds_replay_starts
    for hook in ("init_device", "load_model", "execute_model", "sample_tokens"):
        assert getattr(worker, hook) is getattr(DeepInferWorkerMixin, hook)


class V1Runner:
    """Stands for a V1 model runner class: built from (vllm_config, device), has the
    persistent batch and the drafting hook."""

    def __init__(self, vllm_config, device):
        self.vllm_config, self.device = vllm_config, device
        self.speculative_config = SimpleNamespace(method="ngram")
        self.drafter = "vLLM's ngram proposer"
        self.input_batch = SimpleNamespace(req_ids=[], token_ids_cpu=None)

    def propose_draft_token_ids(self, *args):
        return "base"


class V2Runner:
    """Model Runner V2 has neither."""


def test_dspark_runner_subclasses_the_runner_vllm_built():
    built = dspark_runner.build(V1Runner("cfg", "cpu"), "cfg", "cpu")
    assert isinstance(built, V1Runner) and isinstance(built, dspark_runner.DSparkRunnerMixin)
    assert type(built).__name__ == "DSparkV1Runner"
    assert type(dspark_runner.build(V1Runner("cfg", "cpu"), "cfg", "cpu")) is type(built)
    # Not method "dspark": vLLM's drafter stays, and drafting is vLLM's.
    assert built.propose_draft_token_ids(None, []) == "base"


def test_dspark_runner_refuses_model_runner_v2():
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        dspark_runner.build(V2Runner(), "cfg", "cpu")


def test_replay_feed_refuses_a_runner_without_a_persistent_batch(monkeypatch):
    monkeypatch.delenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", raising=False)
    replay_feed.check_runner(V1Runner("cfg", "cpu"))  # V1: fed
    with pytest.raises(envs.ConfigError, match="DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=0"):
        replay_feed.check_runner(V2Runner())
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "0")
    replay_feed.check_runner(V2Runner())  # exact mode reads no batch


def test_replay_feed_tells_the_tracker_each_step_and_forgets_the_runner():
    from vllm_deepinfer.kv_cache.bounded_replay import tracker_for

    class Config:  # one engine's config object keys its tracker
        pass

    config, runner = Config(), V1Runner("cfg", "cpu")
    step = SimpleNamespace(
        finished_req_ids=set(),
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
        num_scheduled_tokens={},
    )
    tracker = tracker_for(config)
    with replay_feed.step(config, step, runner):
        assert tracker.runner is runner and tracker.step == 1
    assert tracker.runner is None
    with pytest.raises(RuntimeError), replay_feed.step(config, step, runner):
        raise RuntimeError("the step failed")
    assert tracker.runner is None and tracker.step == 2
    assert replay_feed.stats(config)["replayed_rows"] == 0
