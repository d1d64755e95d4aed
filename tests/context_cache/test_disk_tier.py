"""The persistent tier on its own, through vLLM's tier interface: stored chunks load
back; a missing, corrupt or unreadable file fails its promotion from that block on (the
blocks before it kept, the bad files removed, every later one checked too); a full disk
fails the store; the counters say so; another layout finds nothing."""

import errno
import os
import time
from collections import Counter

import numpy as np
import pytest
from vllm.v1.kv_offload.base import OffloadingKVEventsConfig, ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob

from vllm_deepinfer.context_cache import disk_tier

pytestmark = pytest.mark.unit

CHUNKS, ROW, PAYLOAD = 8, 4096, 3000


class Spec:
    """What the tier reads of vLLM's offloading spec."""

    def __init__(self, dtype: str = "float32"):
        self.config = OffloadingConfig(
            groups=(OffloadingGroupConfig(16, ("model.layers.2.attn.compressed_kv",), 0),),
            worker_kv_bytes_per_block=PAYLOAD,
            enable_kv_cache_events=False,
            extra_config={},
            engine_id="test",
            model=OffloadingModelConfig("tiny", dtype),
            cache=OffloadingCacheConfig(16, 1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
        )
        self.blocks_per_chunk = 1
        self.payload_bytes = PAYLOAD
        self.kv_events_config = OffloadingKVEventsConfig(False, False)


@pytest.fixture
def primary():
    return np.zeros((CHUNKS, ROW), dtype=np.uint8)


def make_tier(root, primary, spec=None):
    return disk_tier.PersistentDiskTier(
        spec or Spec(), memoryview(primary), "disk", str(root), n_read_threads=1, n_write_threads=1
    )


KEYS = [make_offload_key(bytes([i]) * 32, 0) for i in range(4)]


def run(tier, job_id: int, chunk_ids, promotion: bool):
    job = TransferJob(
        job_id, KEYS[: len(chunk_ids)], np.array(chunk_ids), promotion, ReqContext(req_id="r")
    )
    (tier.submit_load if promotion else tier.submit_store)(job)
    tier.drain_jobs()
    [result] = tier.get_finished_jobs()
    return result


def counters(tier) -> dict:
    values = tier.get_stats().data["data"]
    return {
        name: sum(v.values()) if name != disk_tier.LOAD_FAILURES else dict(v)
        for name, v in values.items()
    }


def stored(tier, primary, rng):
    primary[:4, :PAYLOAD] = rng.integers(0, 256, (4, PAYLOAD))
    primary[:4, PAYLOAD - 100 : PAYLOAD] = 0  # a padded tail
    expected = primary[:4, :PAYLOAD].copy()
    assert run(tier, 1, [0, 1, 2, 3], promotion=False).success
    return expected, [tier.file_mapper.get_file_name(k) for k in KEYS]


def test_round_trip_and_renewal(tmp_path, primary):
    tier = make_tier(tmp_path, primary)
    try:
        expected, paths = stored(tier, primary, np.random.default_rng(0))
        # Aged well inside the TTL: older than it, the janitor may evict them first.
        aged = time.time() - 600
        for path in paths:
            os.utime(path, (aged, aged))
        primary[:] = 255
        assert run(tier, 2, [4, 5, 6, 7], promotion=True).success
        assert np.array_equal(primary[4:, :PAYLOAD], expected)
        assert all(os.stat(p).st_mtime > aged for p in paths)  # a hit renews
        figures = counters(tier)
        assert figures[disk_tier.LOADED_BLOCKS] == 4
        assert figures[disk_tier.STORED_BYTES] == sum(os.path.getsize(p) for p in paths)
    finally:
        tier.shutdown()


@pytest.mark.parametrize("fault", ["corrupt", "unreadable", "missing"])
def test_bad_file_fails_from_that_block_on(tmp_path, primary, monkeypatch, fault):
    tier = make_tier(tmp_path, primary)
    try:
        _, paths = stored(tier, primary, np.random.default_rng(1))
        # block 1 bad; block 3 corrupt as well: found by the same load
        with open(paths[3], "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(b"\x01")
        if fault == "corrupt":
            with open(paths[1], "r+b") as f:
                f.seek(100)
                f.write(b"\xff\xfe")
        elif fault == "missing":
            os.remove(paths[1])
        else:  # root reads any file: the open fails as it would for another user
            real_open = os.open

            def refuse(path, *args, **kwargs):
                if path == paths[1]:
                    raise PermissionError(errno.EACCES, "Permission denied", path)
                return real_open(path, *args, **kwargs)

            monkeypatch.setattr(os, "open", refuse)
        result = run(tier, 2, [4, 5, 6, 7], promotion=True)
        assert not result.success and list(result.successful_keys) == KEYS[:1]
        assert not os.path.exists(paths[1]) and not os.path.exists(paths[3])
        assert os.path.exists(paths[0]) and os.path.exists(paths[2])
        reason = {"corrupt": "invalid", "unreadable": "permission", "missing": "missing"}
        expected = Counter({(reason[fault],): 1}) + Counter({("invalid",): 1})
        assert counters(tier)[disk_tier.LOAD_FAILURES] == expected
    finally:
        tier.shutdown()


def test_full_disk_fails_the_store(tmp_path, primary, monkeypatch):
    tier = make_tier(tmp_path, primary)
    try:

        def no_space(*_):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "writev", no_space)
        primary[0, 0] = 1
        assert not run(tier, 1, [0], promotion=False).success
        assert counters(tier)[disk_tier.STORE_FAILURES] == 1
        assert not list(tmp_path.rglob("*.bin"))
    finally:
        tier.shutdown()


def test_another_layout_finds_nothing(tmp_path, primary):
    tier = make_tier(tmp_path, primary)
    try:
        _, paths = stored(tier, primary, np.random.default_rng(2))
    finally:
        tier.shutdown()
    other = make_tier(tmp_path, primary, Spec(dtype="bfloat16"))
    try:
        assert other.file_mapper.get_file_name(KEYS[0]) not in paths
        assert not os.path.exists(other.file_mapper.get_file_name(KEYS[0]))
        namespaces = sorted(p.name for p in tmp_path.iterdir())
        assert len(namespaces) == 2 and all(n.startswith("deepinfer-") for n in namespaces)
    finally:
        other.shutdown()
