"""The host region's file in /dev/shm, which the workers and the scheduler map by name.

vLLM's tiering spec unlinks it only on a clean shutdown, so every killed engine left its
pages in /dev/shm (shared memory the kernel never reclaims). Here a worker makes the
file and the scheduler, the last to map it (vLLM's engine core registers the workers'
KV caches before it builds the scheduler), drops the name: from then on the pages go
when the last process holding a mapping exits, however it exits.
"""

from __future__ import annotations

import contextlib
import os

from vllm.distributed.device_communicators.shm_broadcast import check_shm_free_space


def region_path(engine_id: str) -> str:
    """The name vLLM's SharedOffloadRegion maps an engine's host region under."""
    return f"/dev/shm/vllm_offload_{engine_id}.mmap"


def create_region_file(path: str, size: int) -> bool:
    """Makes the region's file unless another rank has; True when this call made it.
    The regions mapped over it then only join, so none of them unlinks the name."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError:
        return False
    try:
        check_shm_free_space(size, allocation_name="context cache host region in /dev/shm")
        os.ftruncate(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return True


def drop_region_name(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
