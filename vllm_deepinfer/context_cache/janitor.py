"""Keeps a context cache directory within its time to live and its disk cap.

A block file's modification time is its last use (a hit or a repeated store renews it,
block_file.renew). Every sweep removes files unused for the TTL, then, while the
directory holds more than its cap, the least recently used files, down to 90% of the cap
(so a full cache does not sweep on every write). Every instance sharing a directory
sweeps it: a file another instance removed meanwhile is skipped.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable

from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)

STALE_TEMPORARY_SECONDS = 3600
"""A temporary file older than this is a write that was interrupted (a killed engine)."""
CAP_HEADROOM = 0.9
SWEEP_SHARE = 0.05
"""At most this share of the janitor's time is spent sweeping: a directory of millions of
blocks takes seconds to walk, so its sweeps come further apart than the interval."""


class CacheJanitor:
    def __init__(
        self,
        root: str,
        ttl_seconds: float,
        max_bytes: int | None,
        max_disk_fraction: float,
        evicted: Callable[[str], None],
        interval_seconds: float | None = None,
    ):
        """`max_bytes`: the cap; None: `max_disk_fraction` of the space the cache may use
        (what it holds plus what its file system has free). `evicted(reason)` is called
        per removed file, reason `ttl` or `space`."""
        if ttl_seconds <= 0:
            raise ValueError(f"the context cache TTL must be positive, got {ttl_seconds}")
        if not 0 < max_disk_fraction <= 1:
            raise ValueError(f"max_disk_fraction must be in (0, 1], got {max_disk_fraction}")
        self.root = root
        self.ttl_seconds = ttl_seconds
        self.max_bytes = max_bytes
        self.max_disk_fraction = max_disk_fraction
        self.interval = interval_seconds or min(60.0, ttl_seconds / 4)
        self.disk_bytes = 0
        self._evicted = evicted
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        files = []
        for directory, _, names in os.walk(self.root):
            for name in names:
                path = os.path.join(directory, name)
                try:
                    status = os.stat(path)
                except OSError:
                    continue
                age = now - status.st_mtime
                if name.endswith(".tmp"):
                    if age > STALE_TEMPORARY_SECONDS:
                        remove_file(path)
                elif name.endswith(".bin"):
                    if age > self.ttl_seconds:
                        if remove_file(path):
                            self._evicted("ttl")
                    else:
                        files.append((status.st_mtime, status.st_size, path))
        total = sum(size for _, size, _ in files)
        cap = self.cap(total)
        if total > cap:
            files.sort()  # least recently used first
            for _, size, path in files:
                if total <= CAP_HEADROOM * cap:
                    break
                if remove_file(path):
                    total -= size
                    self._evicted("space")
        self.disk_bytes = total

    def cap(self, cached_bytes: int) -> float:
        if self.max_bytes:
            return self.max_bytes
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return float("inf")
        return self.max_disk_fraction * (free + cached_bytes)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, daemon=True, name="deepinfer_context_cache_janitor"
        )
        self._thread.start()

    def sweep_soon(self) -> None:
        """A write found the disk full: sweep now rather than at the next interval."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def pause_after(self, sweep_seconds: float) -> float:
        """Seconds until the next sweep after one that took `sweep_seconds`."""
        return max(self.interval, sweep_seconds / SWEEP_SHARE)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - a failed sweep must not end the cache
                logger.exception("Context cache sweep of %s failed", self.root)
            self._wake.wait(self.pause_after(time.monotonic() - started))
            self._wake.clear()


def remove_file(path: str) -> bool:
    """Whether the file was removed (False: gone already, or not ours to remove)."""
    try:
        os.remove(path)
        return True
    except OSError:
        return False
