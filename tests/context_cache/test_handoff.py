"""P/D over the context cache: the prefill's announcement, and the decode side's bounded
wait through vLLM's tier interface (a block announced but not on disk is asked for again
until it arrives or the wait runs out; then it is a miss, recomputed; counted either
way). The served flow is tests/context_cache/test_disaggregated.py."""

import time

import numpy as np
import pytest
from test_disk_tier import KEYS, Spec, run
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from vllm_deepinfer.context_cache import disk_tier, handoff

pytestmark = pytest.mark.unit

LAYOUT = bytes(range(16))


def test_only_a_router_prefill_request_is_announced():
    assert handoff.wants_announcement({"do_remote_decode": True, "do_remote_prefill": False})
    for params in (None, {}, {"do_remote_decode": False}, ["do_remote_decode"]):
        assert not handoff.wants_announcement(params)
    assert handoff.announcement(LAYOUT, 300) == {
        "deepinfer_global_kv": {"layout": LAYOUT.hex(), "tokens": 300}
    }


def test_a_decode_request_waits_for_its_announcement_only():
    params = handoff.announcement(LAYOUT, 300)
    awaited = handoff.awaited_blocks(params, LAYOUT, 5.0, now=100.0)
    assert (awaited.tokens, awaited.deadline, awaited.waited) == (300, 105.0, False)
    assert handoff.awaited_blocks(None, LAYOUT, 5.0) is None
    assert handoff.awaited_blocks({"other": 1}, LAYOUT, 5.0) is None
    assert handoff.awaited_blocks(params, LAYOUT, 0.0) is None  # waiting off
    # another model or settings: its blocks never arrive under this layout
    assert handoff.awaited_blocks(params, bytes(16), 5.0) is None
    for bad in (
        {"layout": LAYOUT.hex()},
        {"layout": LAYOUT.hex(), "tokens": -1},
        {"layout": LAYOUT.hex(), "tokens": True},
        {"layout": 3, "tokens": 1},
        "x",
    ):
        assert handoff.awaited_blocks({"deepinfer_global_kv": bad}, LAYOUT, 5.0) is None


def make_tier(root, wait_seconds):
    primary = np.zeros((8, 4096), dtype=np.uint8)
    return disk_tier.PersistentDiskTier(
        Spec(),
        memoryview(primary),
        "disk",
        str(root),
        n_read_threads=1,
        n_write_threads=1,
        pd_wait_seconds=wait_seconds,
    )


def decode_request(tier, tokens, req_id="d"):
    context = ReqContext(
        req_id=req_id, kv_transfer_params=handoff.announcement(tier.layout, tokens)
    )
    tier.on_new_request(context)
    for index, key in enumerate(KEYS):
        context.set_offload_key_position(key, 16 * (index + 1))
    return context


def settled(tier, key, context):
    """The tier's verdict once vLLM's asynchronous lookup of `key` has answered."""
    for _ in range(200):
        result = tier.lookup(key, context)
        tier.on_schedule_end(None)
        state = tier._lookup_manager._lookup_state.get(key)
        if result is not LookupResult.RETRY or (state and state.result is not None):
            return result
        time.sleep(0.01)
    return result


def waits(tier) -> dict:
    counts = tier.get_stats().data["data"].get(disk_tier.PD_KV_WAITS, {})
    return {labels[0]: amount for labels, amount in counts.items()}


def test_an_announced_block_is_waited_for_until_it_arrives(tmp_path):
    tier = make_tier(tmp_path, wait_seconds=30.0)
    try:
        context = decode_request(tier, tokens=32)
        assert settled(tier, KEYS[0], context) is LookupResult.RETRY  # not written yet
        assert run(tier, 1, [0], promotion=False).success  # the prefill's write lands
        assert tier.lookup(KEYS[0], context) is LookupResult.HIT
        # beyond what was announced: vLLM's verdict, no wait
        assert settled(tier, KEYS[2], context) is LookupResult.MISS
        tier.on_request_finished(context)
        assert waits(tier) == {"arrived": 1}
    finally:
        tier.shutdown()


def test_the_wait_is_bounded_then_the_block_is_recomputed(tmp_path, caplog):
    tier = make_tier(tmp_path, wait_seconds=0.3)
    try:
        context = decode_request(tier, tokens=64)
        assert settled(tier, KEYS[1], context) is LookupResult.RETRY
        time.sleep(0.35)
        assert tier.lookup(KEYS[1], context) is LookupResult.MISS
        assert tier.lookup(KEYS[1], context) is LookupResult.MISS  # no second wait
        assert "not on disk after" in caplog.text
        tier.on_request_finished(context)
        assert waits(tier) == {"timed_out": 1}
        plain = ReqContext(req_id="p")  # no announcement: never waits
        tier.on_new_request(plain)
        plain.set_offload_key_position(KEYS[3], 64)
        assert settled(tier, KEYS[3], plain) is LookupResult.MISS
    finally:
        tier.shutdown()


def test_steps_that_wait_are_paced_once_per_step(tmp_path):
    """While a request waits, the engine's steps are at least PD_WAIT_STEP_SECONDS apart
    (one sleep per step, however many blocks it asked for); a step without a wait is not
    held."""
    tier = make_tier(tmp_path, wait_seconds=30.0)
    try:
        context = decode_request(tier, tokens=64)
        assert settled(tier, KEYS[0], context) is LookupResult.RETRY
        steps = []
        for _ in range(5):
            for key in KEYS[:3]:  # a step's scan: several announced blocks missing
                assert tier.lookup(key, context) is LookupResult.RETRY
            tier.on_schedule_end(None)
            steps.append(time.monotonic())
        gaps = [later - earlier for earlier, later in zip(steps, steps[1:])]
        assert min(gaps) >= disk_tier.PD_WAIT_STEP_SECONDS * 0.99
        started = time.monotonic()
        tier.on_schedule_end(None)  # no lookup waited in this step
        assert time.monotonic() - started < disk_tier.PD_WAIT_STEP_SECONDS
        tier.on_request_finished(context)
    finally:
        tier.shutdown()
