"""Block files: what was written reads back; another layout, a truncated file, flipped
bytes or a missing file are refused, never returned as KV."""

import os

import pytest

from vllm_deepinfer.context_cache import block_file

pytestmark = pytest.mark.unit

LAYOUT = bytes(range(16))


def payload(n: int = 1000, seed: int = 3) -> memoryview:
    return memoryview(bytes((i * 7 + seed) % 251 for i in range(n)))


def test_round_trip_and_existing_file_renewed(tmp_path):
    path = str(tmp_path / "a" / "b.bin")
    assert block_file.write(path, payload(), LAYOUT)
    os.utime(path, (1000, 1000))
    into = bytearray(1000)
    block_file.read_into(path, memoryview(into), LAYOUT)
    assert bytes(into) == bytes(payload())
    assert not block_file.write(path, payload(seed=4), LAYOUT)  # kept, renewed
    assert os.stat(path).st_mtime > 1000
    assert not [p for p in os.listdir(tmp_path / "a") if p.endswith(".tmp")]


@pytest.mark.parametrize(
    "fault", ["truncate", "flip_payload", "flip_header", "grow", "other_layout", "missing"]
)
def test_damaged_files_refused(tmp_path, fault):
    path = str(tmp_path / "b.bin")
    block_file.write(path, payload(), LAYOUT if fault != "other_layout" else bytes(16))
    data = bytearray(open(path, "rb").read())
    if fault == "truncate":
        data = data[: len(data) - 10]
    elif fault == "flip_payload":
        data[block_file.HEADER_BYTES + 500] ^= 0x40
    elif fault == "flip_header":
        data[0] ^= 1
    elif fault == "grow":
        data += b"\0"
    if fault == "missing":
        os.remove(path)
    else:
        open(path, "wb").write(bytes(data))
    expected = FileNotFoundError if fault == "missing" else block_file.InvalidBlock
    with pytest.raises(expected):
        block_file.read_into(path, memoryview(bytearray(1000)), LAYOUT)


def test_wrong_expected_size_refused(tmp_path):
    path = str(tmp_path / "c.bin")
    block_file.write(path, payload(), LAYOUT)
    with pytest.raises(block_file.InvalidBlock):
        block_file.read_into(path, memoryview(bytearray(999)), LAYOUT)


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    """A full disk: the write fails with ENOSPC and leaves neither the block nor a
    temporary file."""
    import errno

    def no_space(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", no_space)
    path = str(tmp_path / "d.bin")
    with pytest.raises(OSError) as caught:
        block_file.write(path, payload(), LAYOUT)
    assert caught.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def test_trailing_zero_padding_not_written_and_read_back_as_zeros(tmp_path):
    """A block of compact records padded to the pool's widest page: only the bytes up to
    the last nonzero one reach the disk; a reused staging buffer gets zeros back."""
    data = bytearray(4096)
    data[:300] = bytes(payload(300))
    data[1000] = 7
    path = str(tmp_path / "p.bin")
    block_file.write(path, memoryview(data), LAYOUT)
    assert os.path.getsize(path) == block_file.HEADER_BYTES + 1001
    into = bytearray(b"\xff" * 4096)
    block_file.read_into(path, memoryview(into), LAYOUT)
    assert into == data
    empty = str(tmp_path / "z.bin")
    block_file.write(empty, memoryview(bytes(64)), LAYOUT)
    block_file.read_into(empty, memoryview(into)[:64], LAYOUT)
    assert os.path.getsize(empty) == block_file.HEADER_BYTES and into[:64] == bytes(64)


@pytest.mark.parametrize(
    "size,last",
    [
        (0, None),
        (5000, None),
        (5000, 0),
        (5000, 4999),
        # data ending at, just before and just after a scan chunk's edge, several chunks in
        (200_000, 200_000 - (1 << 15)),
        (200_000, 200_000 - (1 << 15) - 1),
        (200_000, 200_000 - 3 * (1 << 15) + 1),
        (200_000, 17),
    ],
)
def test_stored_length_is_the_payload_up_to_its_last_nonzero_byte(size, last):
    data = bytearray(size)
    if last is not None:
        data[: last + 1 : 97] = b"\x05" * len(range(0, last + 1, 97))
        data[last] = 9
    assert block_file.stored_length(memoryview(bytes(data))) == len(bytes(data).rstrip(b"\0"))
