"""Checkpoint tensors read in place through a memory map of their safetensors file.

Engram's tables (about 100 GB a layer in V4.1-Flash) are looked up a few rows per token;
mapping the file makes the table's resident cost the pages recently read (the kernel's
page cache, shared between processes mapping the same file and given back under memory
pressure) instead of its size. The map is private and read-only in use: nothing is
written to the file.

A first read of a row is a page fault served from disk (or, on a network file system, a
round trip to the server per page: a cold table there costs that latency per token until
its pages are cached); later reads of the same pages come from the page cache. The map
is advised random access (MADV_RANDOM), so a cold row reads its page, not the kernel's
readahead window around it."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import sys

import torch

# safetensors dtype names -> torch dtypes (those a V4.1 checkpoint stores).
_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "U8": torch.uint8,
    "I8": torch.int8,
}


class MappedTensorError(ValueError):
    """The tensor is not in the checkpoint's safetensors files, or cannot be mapped."""


def _header(path: str) -> tuple[dict, int]:
    """A safetensors file's header and the offset its data starts at."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)), 8 + length


def _file_holding(checkpoint_dir: str, name: str) -> str:
    index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            file = json.load(f)["weight_map"].get(name)
        if file is not None:
            return os.path.join(checkpoint_dir, file)
    for file in sorted(os.listdir(checkpoint_dir)):
        if file.endswith(".safetensors") and name in _header(os.path.join(checkpoint_dir, file))[0]:
            return os.path.join(checkpoint_dir, file)
    raise MappedTensorError(f"no safetensors file in {checkpoint_dir} holds {name}")


def mapped_tensor(checkpoint_dir: str, name: str) -> torch.Tensor:
    """Tensor `name` of the checkpoint, backed by a private map of its file (no read)."""
    path = _file_holding(checkpoint_dir, name)
    header, data_start = _header(path)
    entry = header[name]
    dtype = _DTYPES.get(entry["dtype"])
    if dtype is None:
        raise MappedTensorError(f"{name}: cannot map safetensors dtype {entry['dtype']}")
    begin, end = entry["data_offsets"]
    offset = data_start + begin
    if offset % dtype.itemsize:
        raise MappedTensorError(f"{name} starts at byte {offset}, unaligned for {dtype}")
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=os.path.getsize(path))
    raw = torch.empty(0, dtype=torch.uint8).set_(storage, offset, (end - begin,))
    _advise_random(storage.data_ptr(), storage.nbytes())
    return raw.view(dtype).view(entry["shape"])


def _advise_random(address: int, length: int) -> None:
    """MADV_RANDOM on a map (Linux; elsewhere the kernel's default read-ahead stays)."""
    if not sys.platform.startswith("linux") or length == 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise(address, length, mmap.MADV_RANDOM)
