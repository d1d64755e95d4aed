"""One persisted block (chunk) of global KV: a fixed header, then the payload without
its trailing zero bytes.

vLLM's hybrid KV cache gives every block of its pool the page of the widest group, so a
block of global KV in compact records (the release precisions) is mostly zero padding;
only the bytes up to the last nonzero one are written, and the rest is read back as zeros.

The header names the layout the bytes were written for and carries the payload's CRC32,
so a file from another layout, a truncated file or flipped bytes are refused on load (a
miss that recomputes) instead of reaching the model as KV. Files are written to a
temporary name and renamed into place, so a reader never sees a half-written block.
"""

from __future__ import annotations

import os
import random
import struct
import zlib

import numpy as np

MAGIC = b"DIKV"
FORMAT_VERSION = 1
# magic, version, reserved, payload bytes, stored bytes, layout, crc32 of the stored bytes
_HEADER = struct.Struct("<4sHHQQ16sI")
HEADER_BYTES = 64
# Bytes of payload searched at a time for its last nonzero byte.
_SCAN_CHUNK = 1 << 15


class InvalidBlock(OSError):
    """A block file that exists but cannot be used: wrong layout, wrong size, bad checksum."""


def stored_length(payload: memoryview) -> int:
    """The payload's length up to its last nonzero byte, searched from the end a chunk at a
    time: the zero padding after the data is most of a block, and the data itself is
    never indexed beyond its last chunk."""
    data = np.frombuffer(payload, dtype=np.uint8)
    end = len(data)
    while end > 0:
        start = max(0, end - _SCAN_CHUNK)
        nonzero = np.flatnonzero(data[start:end])
        if len(nonzero):
            return start + int(nonzero[-1]) + 1
        end = start
    return 0


def header(payload: memoryview, stored: int, layout: bytes) -> bytes:
    packed = _HEADER.pack(
        MAGIC, FORMAT_VERSION, 0, len(payload), stored, layout, zlib.crc32(payload[:stored])
    )
    return packed.ljust(HEADER_BYTES, b"\0")


def write(path: str, payload: memoryview, layout: bytes) -> int:
    """Writes the block unless a file is already there (then renews it: a block stored
    again is in use). Returns the bytes written (0: the file was there)."""
    if os.path.exists(path):
        renew(path)
        return 0
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{random.getrandbits(48):012x}.tmp"
    try:
        fd = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            stored = stored_length(payload)
            expected = HEADER_BYTES + stored
            written = os.writev(fd, [header(payload, stored, layout), payload[:stored]])
            if written != expected:
                raise OSError(f"short write to {temporary}: {written} of {expected} bytes")
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.remove(temporary)
        except OSError:
            pass
        raise
    return expected


def read_into(path: str, into: memoryview, layout: bytes) -> None:
    """Reads the block's payload into `into` (exactly its length) and checks it; raises
    FileNotFoundError / PermissionError / InvalidBlock / OSError. `into` may hold partial
    bytes after a failure: the caller treats the block as missing."""
    fd = os.open(path, os.O_RDONLY)
    try:
        magic, version, _, length, stored, file_layout, crc = _HEADER.unpack(
            os.pread(fd, _HEADER.size, 0).ljust(_HEADER.size, b"\0")
        )
        if magic != MAGIC or version != FORMAT_VERSION:
            raise InvalidBlock(f"{path}: not a version {FORMAT_VERSION} block file")
        if file_layout != layout or length != len(into) or stored > length:
            raise InvalidBlock(f"{path}: written for another layout")
        size = os.fstat(fd).st_size
        if size != HEADER_BYTES + stored:
            raise InvalidBlock(f"{path}: {size} bytes, expected {HEADER_BYTES + stored}")
        if os.preadv(fd, [into[:stored]], HEADER_BYTES) != stored:
            raise InvalidBlock(f"{path}: short read")
        if zlib.crc32(into[:stored]) != crc:
            raise InvalidBlock(f"{path}: checksum mismatch")
        into[stored:] = bytes(len(into) - stored)
    finally:
        os.close(fd)


def renew(path: str) -> None:
    """Marks the block used now (its modification time is its last use)."""
    try:
        os.utime(path)
    except OSError:
        pass  # removed or not ours to touch: it simply ages out
