"""benchmarks/plots.py: the PNG every benchmark's --json writes beside its JSON."""

import importlib.util
import struct
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _load_plots():
    """benchmarks/ is a folder of scripts, not a package (as in test_model_costs.py)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "plots.py"
    spec = importlib.util.spec_from_file_location("plots", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plots = _load_plots()

PANELS = {
    "tokens/s": {
        "batch 1": {"plugin": 12.5, "llama": 30.0, "reference": 1.5},
        "batch 8": {"plugin": 80.0, "llama": 150.0, "reference": None},
    },
    "seconds": {"compile": {"plugin": 90.0, "llama": 40.0}},
}


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    assert data[-12:-4] == b"\x00\x00\x00\x00IEND"  # ends with an empty IEND chunk
    return struct.unpack(">II", data[16:24])


def test_writes_a_png_beside_the_json(tmp_path):
    json_path = tmp_path / "out.json"
    json_path.write_text("{}")
    written = plots.write_plot(
        str(json_path), "a benchmark", PANELS, baselines={"seconds": 10.0}
    )  # bars rise from 10
    assert written == str(tmp_path / "out.png")
    width, height = _png_size(Path(written))
    # two panels side by side: wider than tall, readable, not a poster
    assert 600 <= width <= 2000 and 300 <= height <= 1000 and width > height
    assert Path(written).stat().st_size > 5000  # bars and text were drawn


def test_png_path():
    assert plots.png_path("/tmp/a/eplb.json") == "/tmp/a/eplb.png"
    assert plots.png_path("results") == "results.png"


def test_without_matplotlib_the_json_stands_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert plots.write_plot(str(tmp_path / "out.json"), "t", PANELS) is None
    assert not (tmp_path / "out.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err
