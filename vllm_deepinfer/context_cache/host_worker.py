"""Copies KV blocks between the engine's paged caches and the host staging region when
both live in host memory (vLLM's CPU offloading worker drives CUDA/XPU copy engines and
refuses every other platform).

The host region is vLLM's `SharedOffloadRegion`, laid out as its own worker lays it out
(each canonical tensor's pages of a chunk side by side in this worker's slot), so the
secondary tiers read and write the same bytes on every platform. Copies run synchronously
when submitted: they are memory copies on the cores the model runs on, and the connector
submits them between steps (loads before the step's forward, stores at the start of the
next step), so there is nothing to overlap them with.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from vllm_deepinfer.context_cache.host_region import drop_region_name


class HostCopyWorker(OffloadingWorker):
    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        region: SharedOffloadRegion,
        made_region_file: str | None = None,
    ):
        """`made_region_file`: the region's file when this worker made it; its name goes
        at shutdown if the scheduler never came to drop it."""
        self._region = region
        self._made_region_file = made_region_file
        self._blocks_per_chunk = blocks_per_chunk
        # Per canonical tensor: device pages (num_blocks, page) and host pages
        # (num_chunks, blocks_per_chunk, page), both int8 views sharing storage.
        self._device: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for cache in kv_caches.tensors:
            page = cache.page_size_bytes
            self._device.append(cache.tensor.view(torch.int8).view(-1, page))
            self._host.append(
                region.create_next_worker_view(page * blocks_per_chunk).unflatten(
                    1, (blocks_per_chunk, page)
                )
            )
        self._refs = kv_caches.group_data_refs
        self._finished: list[TransferResult] = []

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self._finished.append(self._copy(job_id, src_spec, dst_spec, to_host=True))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        self._finished.append(self._copy(job_id, dst_spec, src_spec, to_host=False))
        return True

    def _copy(
        self, job_id: int, device_spec: GPULoadStoreSpec, host_spec: LoadStoreSpec, to_host: bool
    ) -> TransferResult:
        assert isinstance(host_spec, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        blocks = np.asarray(device_spec.block_ids, dtype=np.int64)
        chunks = np.asarray(host_spec.block_ids, dtype=np.int64)
        moved = 0
        block_at = chunk_at = 0
        for refs, count, first in zip(
            self._refs, device_spec.group_sizes, device_spec.block_indices
        ):
            if not count:
                continue
            # The group's blocks are logical blocks first..first+count-1 of the request;
            # the first host chunk may start part-way in (first % blocks_per_chunk).
            logical = (first % self._blocks_per_chunk) + np.arange(count)
            group_chunks = chunks[chunk_at:][logical // self._blocks_per_chunk]
            chunk_index = torch.from_numpy(group_chunks)
            sub_index = torch.from_numpy(logical % self._blocks_per_chunk)
            block_index = torch.from_numpy(blocks[block_at : block_at + count])
            for ref in refs:
                device, host, size = (
                    self._device[ref.tensor_idx],
                    self._host[ref.tensor_idx],
                    ref.page_size_bytes,
                )
                if to_host:
                    host[chunk_index, sub_index, :size] = device[block_index, :size]
                else:
                    device[block_index, :size] = host[chunk_index, sub_index, :size]
                moved += count * size
            block_at += count
            chunk_at += -(-(int(logical[-1]) + 1) // self._blocks_per_chunk)
        return TransferResult(job_id, True, moved, time.perf_counter() - start)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy completed when it was submitted

    def shutdown(self) -> None:
        self._host.clear()  # the region's mapping closes only when no view is left
        self._device.clear()
        self._region.cleanup()
        if self._made_region_file is not None:
            drop_region_name(self._made_region_file)
