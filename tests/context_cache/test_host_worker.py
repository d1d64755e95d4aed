"""The host worker against a plain loop over the same blocks (its torch twin): stores
put each device block's page at its chunk and sub-block in the host region, loads bring
them back, for two groups with different refs, chunks of two blocks and groups starting
part-way into a chunk."""

import uuid

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from vllm_deepinfer.context_cache.host_worker import HostCopyWorker

pytestmark = pytest.mark.unit

BLOCKS, CHUNKS, PER_CHUNK = 12, 8, 2
PAGES = (96, 64)


def make_worker():
    caches = [torch.randint(-128, 127, (BLOCKS, page), dtype=torch.int8) for page in PAGES]
    canonical = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, page) for t, page in zip(caches, PAGES)],
        # group 0: both tensors (the second with a page it fills only partly); group 1: one
        [[CanonicalKVCacheRef(0, 96), CanonicalKVCacheRef(1, 48)], [CanonicalKVCacheRef(1, 64)]],
    )
    row = sum(PAGES) * PER_CHUNK
    row += -row % 4096
    region = SharedOffloadRegion(
        engine_id=f"test-{uuid.uuid4().hex}",
        num_chunks=CHUNKS,
        rank=0,
        kv_bytes_per_chunk=row,
        cpu_page_size=sum(PAGES) * PER_CHUNK,
    )
    return HostCopyWorker(canonical, PER_CHUNK, region), caches, region


def host_page(region, tensor: int, chunk: int, sub: int) -> torch.Tensor:
    """Where the twin says block `sub` of `chunk` lives for canonical tensor `tensor`."""
    row = region.base_tensor.view(CHUNKS, -1)[chunk]
    offset = sum(PAGES[:tensor]) * PER_CHUNK + sub * PAGES[tensor]
    return row[offset : offset + PAGES[tensor]]


def test_store_then_load_matches_the_twin():
    worker, caches, region = make_worker()
    try:
        # group 0: logical blocks 1..3 (starts mid chunk) in device blocks 4, 7, 2 -> chunks 5, 0
        # group 1: logical blocks 0..1 in device blocks 9, 10 -> chunk 3
        device = GPULoadStoreSpec([4, 7, 2, 9, 10], group_sizes=(3, 2), block_indices=(1, 0))
        worker.submit_store(1, device, CPULoadStoreSpec(np.array([5, 0, 3])))
        placement = {0: [(4, 5, 1), (7, 0, 0), (2, 0, 1)], 1: [(9, 3, 0), (10, 3, 1)]}
        refs = {0: [(0, 96), (1, 48)], 1: [(1, 64)]}
        for group, blocks in placement.items():
            for block, chunk, sub in blocks:
                for tensor, size in refs[group]:
                    assert torch.equal(
                        host_page(region, tensor, chunk, sub)[:size], caches[tensor][block, :size]
                    )
        [result] = worker.get_finished()
        assert result.success and result.transfer_size == 3 * (96 + 48) + 2 * 64

        saved = [c.clone() for c in caches]
        for c in caches:
            c.zero_()
        worker.submit_load(
            2,
            CPULoadStoreSpec(np.array([5, 0, 3])),
            GPULoadStoreSpec([1, 3, 5, 6, 8], group_sizes=(3, 2), block_indices=(1, 0)),
        )
        for group, new_blocks in ((0, [1, 3, 5]), (1, [6, 8])):
            for (old, _, _), new in zip(placement[group], new_blocks):
                for tensor, size in refs[group]:
                    assert torch.equal(caches[tensor][new, :size], saved[tensor][old, :size])
        assert [r.job_id for r in worker.get_finished()] == [2]
    finally:
        worker.shutdown()
