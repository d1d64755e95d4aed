"""One persisted block (chunk) of global KV: a fixed header, then the payload.

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

MAGIC = b"DIKV"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHHQ16sI")  # magic, version, reserved, payload bytes, layout, crc32
HEADER_BYTES = 64


class InvalidBlock(OSError):
    """A block file that exists but cannot be used: wrong layout, wrong size, bad checksum."""


def header(payload: memoryview, layout: bytes) -> bytes:
    packed = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(payload), layout,
                          zlib.crc32(payload))
    return packed.ljust(HEADER_BYTES, b"\0")


def write(path: str, payload: memoryview, layout: bytes) -> bool:
    """Writes the block unless a file is already there (then renews it: a block stored
    again is in use). Returns whether bytes were written."""
    if os.path.exists(path):
        renew(path)
        return False
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{random.getrandbits(48):012x}.tmp"
    try:
        fd = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            expected = HEADER_BYTES + len(payload)
            written = os.writev(fd, [header(payload, layout), payload])
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
    return True


def read_into(path: str, into: memoryview, layout: bytes) -> None:
    """Reads the block's payload into `into` (exactly its length) and checks it; raises
    FileNotFoundError / PermissionError / InvalidBlock / OSError. `into` may hold partial
    bytes after a failure: the caller treats the block as missing."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != HEADER_BYTES + len(into):
            raise InvalidBlock(f"{path}: {size} bytes, expected {HEADER_BYTES + len(into)}")
        magic, version, _, length, file_layout, crc = _HEADER.unpack(
            os.pread(fd, _HEADER.size, 0))
        if magic != MAGIC or version != FORMAT_VERSION:
            raise InvalidBlock(f"{path}: not a version {FORMAT_VERSION} block file")
        if file_layout != layout or length != len(into):
            raise InvalidBlock(f"{path}: written for another layout")
        if os.preadv(fd, [into], HEADER_BYTES) != len(into):
            raise InvalidBlock(f"{path}: short read")
        if zlib.crc32(into) != crc:
            raise InvalidBlock(f"{path}: checksum mismatch")
    finally:
        os.close(fd)


def renew(path: str) -> None:
    """Marks the block used now (its modification time is its last use)."""
    try:
        os.utime(path)
    except OSError:
        pass  # removed or not ours to touch: it simply ages out
