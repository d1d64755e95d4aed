"""The persistent tier: vLLM's file-system tier (a file per block under a shared root,
looked up by existence, loaded and stored by its I/O thread pool) with the parts a
long-running shared cache needs:

- every file checked on load (`block_file.py`): a missing, truncated, corrupt, unreadable
  or foreign file fails the promotion, which vLLM turns into a miss that recomputes;
  a bad file is removed so the recomputed block is stored again;
- files kept under a directory named by the layout (`layout.py`);
- a time to live and a disk cap (`janitor.py`): files unused for `ttl_seconds` are
  removed, and the least recently used ones while the directory holds more than
  `max_bytes` (or `max_disk_fraction` of the space the cache may use);
- the decode half of P/D disaggregation (`handoff.py`): a request whose prefill
  instance announced its global KV waits, up to `pd_wait_seconds`, for those blocks to
  reach the directory;
- its counters (blocks loaded, bytes stored, files evicted, failures by reason, P/D
  waits by outcome) in the connector's stats, which vLLM's API server exports to
  Prometheus.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections import Counter
from typing import Any

from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import LookupResult, OffloadingCounterMetadata, OffloadingGaugeMetadata
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

from vllm_deepinfer.context_cache import block_file, handoff
from vllm_deepinfer.context_cache.janitor import CacheJanitor, remove_file
from vllm_deepinfer.context_cache.layout import (
    LAYOUT_FILE,
    NAMESPACE_PREFIX,
    layout_digest,
    layout_fields,
    other_layouts,
)
from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)

DEFAULT_TTL_SECONDS = 3 * 24 * 3600
DEFAULT_MAX_DISK_FRACTION = 0.5

LOADED_BLOCKS = "deepinfer:context_cache_loaded_blocks"
STORED_BYTES = "deepinfer:context_cache_stored_bytes"
DISK_BYTES = "deepinfer:context_cache_disk_bytes"
EVICTED_FILES = "deepinfer:context_cache_evicted_files"
LOAD_FAILURES = "deepinfer:context_cache_load_failures"
STORE_FAILURES = "deepinfer:context_cache_store_failures"
PD_KV_WAITS = "deepinfer:pd_kv_waits"
DEFAULT_PD_WAIT_SECONDS = 10.0
PD_WAIT_STEP_SECONDS = 0.01
"""The least time between engine steps while a request waits for announced blocks. A
waiting request keeps vLLM's engine loop stepping without work; unpaced, it spins the
engine core and its worker flat out (hundreds of empty steps a second), taking the
cores from the instance's running requests and from anything else on the machine."""


_METRIC_NAMES = (
    LOADED_BLOCKS,
    STORED_BYTES,
    DISK_BYTES,
    EVICTED_FILES,
    LOAD_FAILURES,
    STORE_FAILURES,
    PD_KV_WAITS,
)


def _unregister_previous(names) -> None:
    """Drops an earlier stat logger's collectors of these metrics: vLLM's Prometheus
    logger unregisters only `vllm:` collectors before it builds its own, so a second
    engine in one process would otherwise fail to register them."""
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", None) in names:
            REGISTRY.unregister(collector)


def _failure_reason(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "missing"
    if isinstance(exc, PermissionError):
        return "permission"
    if isinstance(exc, block_file.InvalidBlock):
        return "invalid"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no_space"
    return "io_error"


class PersistentDiskTier(FileSystemTierManager):
    def __init__(
        self,
        offloading_spec,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        ttl_seconds: float = DEFAULT_TTL_SECONDS,
        max_bytes: int | None = None,
        max_disk_fraction: float = DEFAULT_MAX_DISK_FRACTION,
        sweep_interval_seconds: float | None = None,
        pd_wait_seconds: float = DEFAULT_PD_WAIT_SECONDS,
        **fs_options: Any,
    ):
        self.root = os.path.abspath(root_dir)
        self.pd_wait_seconds = float(pd_wait_seconds)
        self.payload_bytes = int(offloading_spec.payload_bytes)
        fields = layout_fields(offloading_spec.config, self.payload_bytes)
        self.layout = layout_digest(fields)
        namespace = os.path.join(self.root, NAMESPACE_PREFIX + self.layout.hex())
        layout_path = os.path.join(namespace, LAYOUT_FILE)
        try:
            os.makedirs(namespace, exist_ok=True)
            if not os.path.exists(layout_path):
                with open(layout_path, "w") as f:
                    json.dump(fields, f, indent=1, sort_keys=True)
        except OSError as exc:
            raise ValueError(
                f"The context cache directory {self.root} cannot be used: {exc}"
            ) from exc
        super().__init__(offloading_spec, primary_kv_view, tier_type, namespace, **fs_options)
        for difference in other_layouts(self.root, fields):
            logger.warning(
                "Context cache %s also holds blocks of another layout, which this "
                "engine does not use (%s)",
                self.root,
                difference,
            )
        self._counts: Counter = Counter()
        self._counts_lock = threading.Lock()
        self._retried_this_step = False
        self._last_waiting_step = 0.0
        self._logged_failures: set[str] = set()
        self.janitor = CacheJanitor(
            self.root,
            float(ttl_seconds),
            max_bytes,
            max_disk_fraction,
            lambda reason: self._count(EVICTED_FILES, label=reason),
            sweep_interval_seconds,
        )
        self.janitor.start()
        logger.info(
            "Context cache at %s (layout %s): %d-byte blocks, TTL %.0f s, cap %s",
            self.root,
            self.layout.hex(),
            self.payload_bytes,
            ttl_seconds,
            f"{max_bytes} bytes" if max_bytes else f"{max_disk_fraction:.0%} of the space left",
        )

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict:
        _unregister_previous(_METRIC_NAMES)
        return {
            LOADED_BLOCKS: OffloadingCounterMetadata(
                documentation="Global-KV blocks loaded from the context cache on disk."
            ),
            STORED_BYTES: OffloadingCounterMetadata(
                documentation="Bytes of global KV written to the context cache on disk."
            ),
            DISK_BYTES: OffloadingGaugeMetadata(
                documentation="Bytes the context cache directory holds (last sweep)."
            ),
            EVICTED_FILES: OffloadingCounterMetadata(
                documentation="Context cache files removed, by reason: ttl (unused for "
                "the time to live) or space (over the disk cap, LRU).",
                labelnames=("reason",),
            ),
            LOAD_FAILURES: OffloadingCounterMetadata(
                documentation="Context cache blocks that could not be loaded (each "
                "recomputed), by reason: missing, permission, invalid "
                "(truncated, corrupt or another layout), io_error.",
                labelnames=("reason",),
            ),
            STORE_FAILURES: OffloadingCounterMetadata(
                documentation="Context cache blocks that could not be written, by reason "
                "(no_space, permission, io_error).",
                labelnames=("reason",),
            ),
            PD_KV_WAITS: OffloadingCounterMetadata(
                documentation="Decode requests that waited for global KV their "
                "prefill instance announced, by outcome: arrived (found "
                "within DEEPINFER_PD_KV_WAIT_SECONDS) or timed_out (the rest "
                "recomputed).",
                labelnames=("outcome",),
            ),
        }

    def _count(self, name: str, amount: int = 1, label: str | None = None) -> None:
        with self._counts_lock:
            self._counts[(name, label)] += amount

    def _failed(self, what: str, path: str, exc: BaseException) -> str:
        reason = _failure_reason(exc)
        key = f"{what}:{reason}"
        if key not in self._logged_failures:  # once per kind; the counters keep the rest
            self._logged_failures.add(key)
            logger.warning(
                "Context cache %s failed (%s), recomputing instead: %s", what, reason, exc
            )
        if reason == "no_space":
            self.janitor.sweep_soon()
        return reason

    def _chunk(self, chunk_id) -> memoryview:
        offset = int(chunk_id) * self._block_size
        return self._primary_kv_view.cast("B")[offset : offset + self.payload_bytes]

    @override
    def on_new_request(self, req_context):
        awaited = handoff.awaited_blocks(
            req_context.kv_transfer_params, self.layout, self.pd_wait_seconds
        )
        if awaited is not None:
            req_context.set_state(awaited)
        return super().on_new_request(req_context)

    @override
    def lookup(self, key, req_context) -> LookupResult:
        """vLLM's lookup; for a decode request, a block its prefill announced that is not
        on disk yet is asked for again (RETRY: the request waits a step) until it arrives
        or the wait runs out."""
        result = super().lookup(key, req_context)
        awaited = req_context.get_state(handoff.AwaitedBlocks)
        if result is not LookupResult.MISS or awaited is None or awaited.timed_out:
            return result
        position = req_context.get_offload_key_position(key)
        if position is None or position > awaited.tokens:
            return result
        # vLLM's lookup keeps its first verdict for the request's life: check the file.
        if os.path.exists(self.file_mapper.get_file_name(key)):
            return LookupResult.HIT
        if time.monotonic() < awaited.deadline:
            awaited.waited = True
            self._retried_this_step = True
            return LookupResult.RETRY
        awaited.timed_out = True
        logger.warning(
            "P/D: the global KV its prefill instance announced for request %s "
            "(%d tokens) was not on disk after %.1f s from token %d on; "
            "recomputing from there",
            req_context.req_id,
            awaited.tokens,
            time.monotonic() - awaited.started,
            position,
        )
        return result

    @override
    def on_schedule_end(self, context) -> None:
        """Paces the steps of an engine whose requests wait for announced blocks (at
        most one step per PD_WAIT_STEP_SECONDS), with a sleep once per step."""
        super().on_schedule_end(context)
        if not self._retried_this_step:
            return
        self._retried_this_step = False
        time.sleep(max(0.0, self._last_waiting_step + PD_WAIT_STEP_SECONDS - time.monotonic()))
        self._last_waiting_step = time.monotonic()

    @override
    def on_request_finished(self, req_context) -> None:
        awaited = req_context.get_state(handoff.AwaitedBlocks)
        if awaited is not None and awaited.waited:
            self._count(PD_KV_WAITS, label="timed_out" if awaited.timed_out else "arrived")
        super().on_request_finished(req_context)

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        paths = [self.file_mapper.get_file_name(key) for key in job_metadata.keys]
        chunk_ids = list(job_metadata.chunk_ids)

        def store() -> None:
            for path, chunk_id in zip(paths, chunk_ids):
                try:
                    written = block_file.write(path, self._chunk(chunk_id), self.layout)
                    if written:
                        self._count(STORED_BYTES, written)
                except OSError as exc:
                    self._count(STORE_FAILURES, label=self._failed("store", path, exc))
                    raise

        self._job_block_counts[job_metadata.job_id] = len(paths)
        self._pool.enqueue_store(job_metadata.job_id, 1, [store])

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        paths = [self.file_mapper.get_file_name(key) for key in keys]
        chunk_ids = list(job_metadata.chunk_ids)
        self._load_job_keys[job_id] = keys
        self._job_block_counts[job_id] = len(keys)

        def load() -> None:
            failure = None
            for index, (path, chunk_id) in enumerate(zip(paths, chunk_ids)):
                try:
                    block_file.read_into(path, self._chunk(chunk_id), self.layout)
                except OSError as exc:
                    reason = self._failed("load", path, exc)
                    self._count(LOAD_FAILURES, label=reason)
                    if reason in ("invalid", "permission"):
                        remove_file(path)  # so the recomputed block is stored again
                    if failure is None:
                        # The blocks before this one loaded; get_finished_jobs keeps them.
                        self._load_progress[job_id] = index
                        failure = exc
                    continue
                if failure is None:
                    block_file.renew(path)
                    self._count(LOADED_BLOCKS)
            # The blocks after a failure are recomputed whatever they hold; they are read
            # all the same, so a bad one is removed now rather than at its next hit.
            if failure is not None:
                raise failure

        self._pool.enqueue_load(job_id, 1, [load])

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        with self._counts_lock:
            counts, self._counts = self._counts, Counter()
        stats = OffloadingConnectorStats()
        for (name, label), amount in counts.items():
            stats.increase_counter(name, amount, (label,) if label else ())
        stats.set_gauge(DISK_BYTES, self.janitor.disk_bytes)
        return stats

    @override
    def shutdown(self) -> None:
        self.janitor.stop()
        super().shutdown()
