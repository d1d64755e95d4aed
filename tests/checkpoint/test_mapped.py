"""Engram tables read in place: a mapped checkpoint tensor equals the one safetensors loads,
Engram's lookup on the mapped FP8 rows equals the copied, dequantized table's rows, and
only the pages a lookup touches become resident."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_deepinfer.checkpoint.formats import FORMATS, FP8_ROWS
from vllm_deepinfer.checkpoint.mapped import MappedTensorError, mapped_tensor
from vllm_deepinfer.checkpoint.mx_formats import dequantize_rowwise_fp8
from vllm_deepinfer.model.deepseek_v41.engram import V41Engram

pytestmark = pytest.mark.unit

TABLE = "layers.1.engram.embed.weight"


@pytest.fixture
def checkpoint(tmp_path):
    """Two shards with an index: the FP8 table and its scales in the second."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(1000, 64, generator=g)
    stored = FORMATS[FP8_ROWS].write(TABLE, table)
    save_file(
        {"head.weight": torch.randn(8, 4, generator=g).bfloat16()}, tmp_path / "a.safetensors"
    )
    save_file(stored, tmp_path / "b.safetensors")
    weight_map = {"head.weight": "a.safetensors", **dict.fromkeys(stored, "b.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(tmp_path)


def test_mapped_tensors_equal_the_loaded_ones(checkpoint):
    loaded = {
        **load_file(f"{checkpoint}/a.safetensors"),
        **load_file(f"{checkpoint}/b.safetensors"),
    }
    for name, tensor in loaded.items():
        mapped = mapped_tensor(checkpoint, name)
        assert mapped.dtype == tensor.dtype and mapped.shape == tensor.shape
        assert torch.equal(mapped.view(torch.uint8), tensor.view(torch.uint8))
    os.remove(f"{checkpoint}/model.safetensors.index.json")  # found by the files' headers
    assert torch.equal(mapped_tensor(checkpoint, "head.weight"), loaded["head.weight"])
    with pytest.raises(MappedTensorError, match="no safetensors file"):
        mapped_tensor(checkpoint, "layers.2.engram.embed.weight")


@pytest.mark.parametrize("tensor_parallel", [False, True])
def test_engram_lookup_on_the_mapped_table_equals_the_copied_table(checkpoint, tensor_parallel):
    """V41Engram's lookup (the layer op's body) on the map: one rank's columns and rows
    under tensor parallelism, every column on one rank."""
    stored = load_file(f"{checkpoint}/b.safetensors")
    copied = dequantize_rowwise_fp8(stored[TABLE], stored[TABLE.replace(".weight", ".scale")])
    columns, first_row, rows = (
        (slice(3, 6), 400, 600) if tensor_parallel else (slice(0, 6), 0, 1000)
    )
    engram = SimpleNamespace(columns=columns, first_row=first_row, rows=rows, table=None)
    engram.table_scale = None
    V41Engram.map_table(engram, checkpoint, TABLE, scaled=True)
    table_rows = torch.randint(first_row, first_row + rows, (9, 6))
    out = torch.empty(9, columns.stop - columns.start, 64, dtype=torch.bfloat16)
    V41Engram.lookup_step(engram, table_rows, out)
    torch.testing.assert_close(out, copied[table_rows[:, columns]].bfloat16(), rtol=0, atol=0)


def test_only_the_looked_up_pages_become_resident(tmp_path):
    """A 256 MiB table not in the page cache (a cold start), 256 rows looked up: the
    process holds the pages read around each row (the kernel maps up to 64 KiB of cached
    pages around a faulting one), never the table."""
    rows, width = 1 << 20, 256
    save_file({TABLE: torch.zeros(rows, width, dtype=torch.uint8)}, tmp_path / "t.safetensors")
    with open(tmp_path / "t.safetensors", "rb") as f:  # written out, then dropped from cache
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    path = str(tmp_path / "t.safetensors")

    def resident_bytes_of_the_file() -> int:
        """Rss of this process's maps of the table's file (/proc/self/smaps)."""
        total, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                fields = line.split()
                if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                    inside = fields[-1] == path
                elif inside and fields[0] == "Rss:":
                    total += int(fields[1]) * 1024
        return total

    table = mapped_tensor(str(tmp_path), TABLE)
    assert resident_bytes_of_the_file() == 0
    generator = torch.Generator().manual_seed(1)
    looked_up = table.index_select(0, torch.randint(0, rows, (256,), generator=generator))
    grown = resident_bytes_of_the_file()
    assert looked_up.shape == (256, width)
    assert grown <= 256 * (64 << 10) + (1 << 20), grown
    assert grown < table.numel() // 8
