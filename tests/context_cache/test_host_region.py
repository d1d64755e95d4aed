"""The host region's file: a worker makes it, the regions over it only join (so no
region's cleanup unlinks a name), one mapping's writes are the other's after the name
is dropped, and a worker that made the file drops its name at shutdown."""

import os
import uuid

import pytest
import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from vllm_deepinfer.context_cache.host_region import (
    create_region_file,
    drop_region_name,
    region_path,
)
from vllm_deepinfer.context_cache.host_worker import HostCopyWorker

pytestmark = pytest.mark.unit

CHUNKS, ROW = 4, 4096


def region_over(engine_id: str, rank: int | None) -> SharedOffloadRegion:
    return SharedOffloadRegion(
        engine_id=engine_id, num_chunks=CHUNKS, rank=rank, kv_bytes_per_chunk=ROW, cpu_page_size=ROW
    )


@pytest.fixture
def engine_id():
    engine_id = f"test-{uuid.uuid4().hex}"
    yield engine_id
    drop_region_name(region_path(engine_id))


def test_regions_share_pages_after_the_name_is_dropped(engine_id):
    path = region_path(engine_id)
    assert create_region_file(path, CHUNKS * ROW)
    assert not create_region_file(path, CHUNKS * ROW)  # another rank's call joins
    assert os.path.getsize(path) == CHUNKS * ROW
    worker, scheduler = region_over(engine_id, 0), region_over(engine_id, None)
    drop_region_name(path)
    assert not os.path.exists(path)
    worker.base_tensor[5] = 7
    assert scheduler.base_tensor[5] == 7

    open(path, "wb").close()  # a file neither region made
    worker.cleanup()
    scheduler.cleanup()
    assert os.path.exists(path), "a region that joined unlinked a name"


def test_worker_that_made_the_file_drops_its_name_at_shutdown(engine_id):
    path = region_path(engine_id)
    assert create_region_file(path, CHUNKS * ROW)
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(torch.zeros(2, ROW, dtype=torch.int8), ROW)], [[]]
    )
    worker = HostCopyWorker(caches, 1, region_over(engine_id, 0), made_region_file=path)
    worker.shutdown()
    assert not os.path.exists(path)
