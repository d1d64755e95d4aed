"""The parts of bounded replay without an engine: the replayed window spec as vLLM's KV
cache code treats it, the keep setting and where it is refused, the per-engine tracker,
the slots replayed rows may not write, and the reference's replay at the exact bound."""

import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from helpers import logged_records, random_prompts
from vllm_deepinfer import envs
from vllm_deepinfer.kv_cache.bounded_replay import (
    ReplaySettings,
    ReplayTracker,
    ReplayWindowSpec,
    register_replay_specs,
    replay_settings,
)
from vllm_deepinfer.kv_cache.paged import without_replayed_rows

pytestmark = pytest.mark.unit


def window(keep: int, sliding_window: int = 32, **extra) -> ReplayWindowSpec:
    return ReplayWindowSpec(
        block_size=16,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.float32,
        sliding_window=sliding_window,
        replay_tokens=keep,
        **extra,
    )


def test_replayed_windows_are_not_prefix_cached_and_keep_their_replay_blocks():
    spec = window(140)
    assert not spec.prefix_cacheable and spec.prefix_replay_tokens == 140
    # vLLM resets this field on every sliding-window spec, and merge rebuilds the spec.
    assert spec.extra_retained_tokens == 140 - 32 + 1
    assert replace(spec, extra_retained_tokens=0).extra_retained_tokens == 109
    merged = ReplayWindowSpec.merge([window(140, lookback_tokens=3)] * 2)
    assert (merged.replay_tokens, merged.lookback_tokens, merged.extra_retained_tokens) == (
        140,
        3,
        109,
    )
    with pytest.raises(AssertionError):
        ReplayWindowSpec.merge([window(140), window(141)])
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    plain = SlidingWindowMLASpec(
        block_size=16, num_kv_heads=1, head_size=512, dtype=torch.float32, sliding_window=32
    )
    with pytest.raises(AssertionError):  # vLLM's uniformity check relies on it
        ReplayWindowSpec.merge([window(140), plain])
    assert not window(140).is_uniform_with_collection({"a": plain})


def test_the_registry_keeps_its_built_ins_and_manages_replayed_windows_as_windows():
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    register_replay_specs()
    register_replay_specs()  # idempotent: register() runs in every process, often twice
    assert KVCacheSpecRegistry.get_manager_class(window(140)) is SlidingWindowManager
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    assert KVCacheSpecRegistry.get_manager_class(full) is FullAttentionManager


@pytest.mark.parametrize(
    "value,keep", [(None, 140), ("96", 96), ("0", 0), ("off", 0), (" OFF ", 0)]
)
def test_keep_setting(value, keep):
    env = {} if value is None else {"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": value}
    assert envs.load(env).yoco_prefill_keep_tokens == keep


@pytest.mark.parametrize("value", ["abc", "-5", "1.5", ""])
def test_bad_keep_setting_names_the_variable(value):
    with pytest.raises(envs.ConfigError, match="DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"):
        envs.load({"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": value})


CPU_WORKER = "vllm_deepinfer.worker.cpu_worker.DeepInferCPUWorker"
GPU_WORKER = "vllm_deepinfer.worker.gpu_worker.DeepInferGPUWorker"


def config(worker=CPU_WORKER, bounded=True, hybrid_off=False):
    return SimpleNamespace(
        cache_config=SimpleNamespace(swa_bounded_replay=bounded),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=hybrid_off),
        parallel_config=SimpleNamespace(worker_cls=worker),
    )


@pytest.mark.model_runner_v1  # the plugin's workers; tests/plugins/test_vllm_support.py without
def test_replay_settings_against_the_model_and_vllm(tiny_args, monkeypatch):
    monkeypatch.delenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", raising=False)
    assert replay_settings(config(), tiny_args) == ReplaySettings(140, 6)
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "31")
    with pytest.raises(envs.ConfigError, match="smaller than the model's sliding window"):
        replay_settings(config(), tiny_args)
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "32")
    # Both of the plugin's workers feed replay starts, by name or as a class.
    from vllm_deepinfer.worker.gpu_worker import DeepInferGPUWorker

    for worker in (GPU_WORKER, DeepInferGPUWorker):
        assert replay_settings(config(worker=worker), tiny_args) == ReplaySettings(32, 6)
    with logged_records(logging.getLogger("vllm.deepinfer")) as records:
        for off in (
            config(worker="vllm.v1.worker.cpu_worker.CPUWorker"),
            config(bounded=False),
            config(hybrid_off=True),
        ):
            assert replay_settings(off, tiny_args) == ReplaySettings(0, None)
    assert len([r for r in records if "exact mode" in r.getMessage()]) == 3


@pytest.fixture
def tiny_args(tiny_checkpoint):
    from fixtures.reference import read_checkpoint

    return read_checkpoint(tiny_checkpoint)[0]


def new_request(req_id, prompt_len, computed, replay_start, prompt_logprobs=None):
    return SimpleNamespace(
        req_id=req_id,
        prompt_len=prompt_len,
        num_computed_tokens=computed,
        replay_start=replay_start,
        sampling_params=SimpleNamespace(prompt_logprobs=prompt_logprobs),
    )


def scheduler_output(new=(), cached=(), resumed=(), finished=(), scheduled=None):
    ids = [c[0] for c in cached]
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        finished_req_ids=set(finished),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=ids,
            resumed_req_ids=set(resumed),
            num_computed_tokens=[c[1] for c in cached],
            num_output_tokens=[c[2] for c in cached],
        ),
        num_scheduled_tokens=scheduled or {},
    )


def test_tracker_follows_admissions_resumptions_and_the_runner_order():
    tracker = ReplayTracker()
    tracker.configure(keep=40, decoder_replay=True)
    tokens = torch.arange(1000).repeat(4, 1).numpy()
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=["b", "a", "c"], token_ids_cpu=tokens)
    )
    tracker.begin_step(
        scheduler_output(
            new=[
                new_request("a", 300, 160, 160),
                new_request("b", 100, 0, 0),
                new_request("c", 90, 0, 0, prompt_logprobs=0),
            ],
            scheduled={"a": 64, "b": 64, "c": 64},
        ),
        runner,
    )
    view = tracker.view(3)
    assert view.start.tolist() == [0, 160, 0]
    assert view.kept_from.tolist() == [60, 260, 0]  # c wants every row
    assert tracker.tokens_before(view, 3).tolist() == [[-1] * 3, [157, 158, 159], [-1] * 3]
    assert (tracker.replayed_rows, tracker.trimmed_rows) == (40, 60 + 64)
    tracker.end_step()
    assert tracker.view(3) is None  # outside a scheduled step (profile, warm-up runs)
    # "b" is preempted with 30 output tokens and resumes from a 96-token hit.
    tracker.begin_step(
        scheduler_output(
            cached=[("b", 56, 30)], resumed={"b"}, finished={"a", "c"}, scheduled={"b": 74}
        ),
        runner,
    )
    assert set(tracker.requests) == {"b"}
    assert tracker.requests["b"].start == 56 and tracker.requests["b"].kept_from == 60
    assert tracker.stats()["admissions"][-1] == ("b", 56, 60, 130)
    assert tracker.stats()["replayed_requests"] == 2


def test_replayed_rows_write_nothing_into_prefix_cached_groups():
    # request 0: positions 100..107 of a replay from 100 (keep 5); request 1: no replay
    slots = torch.arange(12)
    kept = without_replayed_rows(
        slots, torch.tensor([0, 8, 12]), torch.tensor([108, 20]), torch.tensor([100, 0]), keep=5
    )
    assert kept.tolist() == [-1] * 5 + [5, 6, 7, 8, 9, 10, 11]
    untouched = without_replayed_rows(
        slots, torch.tensor([0, 8, 12]), torch.tensor([108, 20]), torch.tensor([0, 0]), keep=5
    )
    assert untouched is slots


def test_replay_at_the_exact_bound_equals_the_exact_forward(tiny_checkpoint):
    """Every window replayed at least (layers) x (W - 1) = 310 tokens sees no truncation
    by the time it reaches the hit's end; replaying only the window (32) is approximate."""
    from fixtures.reference import ReferenceV41

    reference = ReferenceV41(tiny_checkpoint, dtype=torch.float32)
    tokens = random_prompts((400,), seed=31)[0]
    exact = reference.logits(tokens)[-30:]
    hit = 368
    at_bound = reference.logits(tokens, replays=[(hit - 310, hit)])[-30:]
    below = reference.logits(tokens, replays=[(hit - 32, hit)])[-30:]
    assert torch.allclose(at_bound, exact, atol=1e-4)
    assert not torch.allclose(below, exact, atol=1e-3)
    assert reference.args.decoder_replay_cut == 6


def test_near_ties_are_taken_either_way_from_their_row_on(tiny_checkpoint):
    """The reference lists the indexer top-k selections within TIE_TOLERANCE of a tie
    (the fp32 engine may make them either way); one resolved the other way changes
    nothing before its row and something from it on, and ReferenceRows accepts a row
    that only that resolution gives."""
    from fixtures.reference import ReferenceV41
    from helpers import TIE_TOLERANCE, ReferenceRows, sampled_as_reference

    reference = ReferenceV41(tiny_checkpoint)
    tokens = random_prompts((160,), seed=44)[0][:40]
    rows = ReferenceRows(reference, tokens)
    assert [(t.number, t.layer, t.row) for t in rows.ties] == [(0, 6, 31)]
    assert 0 < rows.ties[0].margin < TIE_TOLERANCE
    flipped = (
        reference.logits(tokens, tie_tolerance=TIE_TOLERANCE, flipped={rows.ties[0].key})
        .log_softmax(-1)
        .float()
    )
    assert torch.equal(flipped[:31], torch.stack([rows.at(row) for row in range(31)]))
    token = flipped[31].argmax().item()
    engine_like = sampled_as_reference(token, flipped[31, token].item())
    assert not engine_like(rows.at(31))
    assert rows.matches(31, engine_like)
    assert not rows.matches(31, sampled_as_reference(token, flipped[31, token].item() + 0.01))
    assert not ReferenceRows(reference, tokens, tolerance=1e-7).matches(31, engine_like)


def test_deterministic_sampling_brings_exact_mode_and_refuses_replay():
    """Seeds stay independent of the prefix cache only in exact mode: deterministic
    sampling makes it the default and refuses a keep that would replay."""
    deterministic = {
        "DEEPINFER_DETERMINISTIC_SAMPLING": "1",
        "DEEPINFER_BATCH_INVARIANT": "1",
        "DEEPINFER_ENABLE_MTP_VARLEN": "0",
    }
    assert envs.load(deterministic).yoco_prefill_keep_tokens == envs.EXACT_MODE
    for exact in ("0", "off"):
        assert (
            envs.load(
                {**deterministic, "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": exact}
            ).yoco_prefill_keep_tokens
            == 0
        )
    with pytest.raises(envs.ConfigError, match="DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=0"):
        envs.load({**deterministic, "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "140"})
    assert envs.load({}).yoco_prefill_keep_tokens == envs.DEFAULT_KEEP_TOKENS
