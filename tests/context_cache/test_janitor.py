"""The janitor: files unused for the TTL go, renewed ones stay; over the cap the least
recently used go first, down to 90% of it; stale temporary files are cleaned."""

import os
import time

import pytest

from vllm_deepinfer.context_cache import block_file
from vllm_deepinfer.context_cache.janitor import STALE_TEMPORARY_SECONDS, CacheJanitor

pytestmark = pytest.mark.unit


def files(root, n, size=1000, start=0.0, step=10.0):
    paths = []
    for i in range(n):
        path = root / f"g{i % 3}" / f"{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
        os.utime(path, (start + i * step, start + i * step))
        paths.append(path)
    return paths


def janitor(root, evicted, **options):
    settings = dict(ttl_seconds=3600.0, max_bytes=None, max_disk_fraction=0.5)
    settings.update(options)
    return CacheJanitor(str(root), evicted=evicted.append, **settings)


def test_ttl_removes_unused_files_and_a_renewed_file_stays(tmp_path):
    now = time.time()
    unused = files(tmp_path, 2, start=now - 7200, step=0)
    evicted = []
    renewed = files(tmp_path / "r", 1, start=now - 7200)[0]
    block_file.renew(str(renewed))  # a hit
    j = janitor(tmp_path, evicted)
    j.sweep(now)
    assert not any(p.exists() for p in unused) and renewed.exists()
    assert evicted == ["ttl", "ttl"]
    assert j.disk_bytes == 1000


def test_cap_evicts_least_recently_used_first(tmp_path):
    now = time.time()
    paths = files(tmp_path, 10, start=now - 100, step=1)
    evicted = []
    j = janitor(tmp_path, evicted, max_bytes=5000)
    j.sweep(now)
    # 10 000 bytes over a 5000 cap: down to 4500, the six oldest removed.
    assert [p.exists() for p in paths] == [False] * 6 + [True] * 4
    assert evicted == ["space"] * 6 and j.disk_bytes == 4000


def test_default_cap_is_a_fraction_of_the_space_the_cache_may_use(tmp_path):
    j = janitor(tmp_path, [], max_disk_fraction=0.25)
    import shutil

    free = shutil.disk_usage(tmp_path).free
    assert j.cap(10**6) == pytest.approx(0.25 * (free + 10**6), rel=1e-3)


def test_stale_temporary_files_cleaned_fresh_ones_kept(tmp_path):
    now = time.time()
    stale, fresh = tmp_path / "a.bin.1.tmp", tmp_path / "b.bin.2.tmp"
    for path in (stale, fresh):
        path.write_bytes(b"t")
    os.utime(stale, (now - STALE_TEMPORARY_SECONDS - 1,) * 2)
    janitor(tmp_path, []).sweep(now)
    assert not stale.exists() and fresh.exists()


def test_files_gone_meanwhile_are_skipped(tmp_path, monkeypatch):
    """Another instance sweeping the same directory removed a file first."""
    now = time.time()
    files(tmp_path, 3, start=now - 7200, step=0)
    real_remove = os.remove

    def raced(path):
        real_remove(path)
        raise FileNotFoundError(path)

    monkeypatch.setattr(os, "remove", raced)
    evicted = []
    janitor(tmp_path, evicted).sweep(now)
    assert evicted == [] and not list(tmp_path.rglob("*.bin"))


def test_settings_checked():
    with pytest.raises(ValueError, match="TTL"):
        CacheJanitor("/tmp", 0, None, 0.5, print)
    with pytest.raises(ValueError, match="max_disk_fraction"):
        CacheJanitor("/tmp", 10, None, 1.5, print)


def test_sweeps_of_a_large_directory_come_further_apart(tmp_path):
    """A sweep that took long (millions of files) is followed by a pause 1 / SWEEP_SHARE
    times as long; a quick one by the interval."""
    from vllm_deepinfer.context_cache.janitor import SWEEP_SHARE

    sweeper = janitor(tmp_path, [], interval_seconds=60.0)
    assert sweeper.pause_after(0.2) == 60.0
    assert sweeper.pause_after(12.0) == pytest.approx(12.0 / SWEEP_SHARE)
