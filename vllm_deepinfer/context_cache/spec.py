"""The offloading spec vLLM's OffloadingConnector loads by `spec_name` +
`spec_module_path` (no patch): vLLM's tiering spec (a host-memory tier in front of the
secondary tiers, here the persistent disk tier), with a worker for engines whose KV
caches live in host memory, which vLLM's own worker refuses. On CUDA, ROCm and XPU
vLLM's worker runs unchanged.

With the host worker, the region's file is made and its name dropped as
`host_region` says, so that a killed engine leaves nothing in /dev/shm.
"""

from __future__ import annotations

import os

from typing_extensions import override
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingWorker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from vllm_deepinfer.context_cache.host_region import (
    create_region_file,
    drop_region_name,
    region_path,
)
from vllm_deepinfer.context_cache.host_worker import HostCopyWorker

logger = init_logger(__name__)

SPEC_NAME = "DeepInferOffloadingSpec"
SPEC_MODULE = __name__


def device_has_copy_engine() -> bool:
    return current_platform.is_cuda_alike() or current_platform.is_xpu()


class DeepInferOffloadingSpec(TieringOffloadingSpec):
    _worker: OffloadingWorker | None  # set to None by vLLM's spec, built on first use

    @property
    def payload_bytes(self) -> int:
        """The bytes of one chunk the workers fill (the rest of its row is alignment)."""
        copies = 1 if self.replicated_layout else self.config.parallel.world_size
        return self.cpu_page_size_per_worker * copies

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if device_has_copy_engine():
            return super().get_worker(kv_caches)
        if self._worker is None:
            if self.config.canonical_layout:
                raise ValueError(
                    "canonical_layout needs vLLM's GPU offloading worker; "
                    "remove it from kv_connector_extra_config on this platform"
                )
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            path = region_path(self.config.engine_id)
            made = create_region_file(path, self.num_chunks * self.kv_bytes_per_chunk)
            try:
                region = SharedOffloadRegion(
                    engine_id=self.config.engine_id,
                    num_chunks=self.num_chunks,
                    rank=rank,
                    kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                    cpu_page_size=self.cpu_page_size_per_worker,
                )
                if region.mmap_path != path:
                    logger.warning(
                        "vLLM maps the host region at %s, not %s: a killed engine leaves "
                        "it in /dev/shm (update context_cache.host_region.region_path)",
                        region.mmap_path,
                        path,
                    )
                    drop_region_name(path)
                    made = False
                try:
                    self._worker = HostCopyWorker(
                        kv_caches, self.blocks_per_chunk, region, path if made else None
                    )
                except BaseException:
                    region.cleanup()
                    raise
            except BaseException:
                if made:
                    drop_region_name(path)
                raise
        return self._worker

    @override
    def get_manager(self) -> OffloadingManager:
        """vLLM's tiering manager; with the host worker, the scheduler's side, the last
        to map the region the workers made, then drops its name."""
        path = region_path(self.config.engine_id)
        workers_made_it = not device_has_copy_engine() and os.path.exists(path)
        manager = super().get_manager()
        if workers_made_it:
            drop_region_name(path)
        return manager
