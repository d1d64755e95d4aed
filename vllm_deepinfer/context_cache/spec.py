"""The offloading spec vLLM's OffloadingConnector loads by `spec_name` +
`spec_module_path` (no patch): vLLM's tiering spec (a host-memory tier in front of the
secondary tiers, here the persistent disk tier), with a worker for engines whose KV
caches live in host memory, which vLLM's own worker refuses. On CUDA, ROCm and XPU
vLLM's worker runs unchanged.
"""

from __future__ import annotations

from typing_extensions import override
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from vllm_deepinfer.context_cache.host_worker import HostCopyWorker

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
            region = SharedOffloadRegion(
                engine_id=self.config.engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, region)
            except Exception:
                region.cleanup()
                raise
        return self._worker
