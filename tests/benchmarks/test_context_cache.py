"""benchmarks/context_cache.py at smoke-run lengths: the JSON has the issue's shape, the
times come from real hits (the script stops if a disk hit after the restart finds
nothing cached) and the fp32 bytes on disk match the formula."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "context_cache.py"
KINDS = ("cold", "memory_hit", "disk_hit_after_restart")
SETTINGS = ("tiny", "tiny_release_precisions")


@pytest.mark.slow  # the benchmark's own run (make bench) and the nightly job measure it
def test_context_cache_benchmark_smoke(tiny_checkpoint, tmp_path):
    out = tmp_path / "context_cache.json"
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model",
            tiny_checkpoint,
            "--lengths",
            "256",
            "512",
            "--rounds",
            "1",
            "--enforce-eager",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out.read_text())
    assert (tmp_path / "context_cache.png").stat().st_size > 0  # benchmarks/plots.py

    assert set(results) == {"ttft_s", "disk_bytes_per_token", "formula_bytes_per_token"}
    assert set(results["ttft_s"]) == set(KINDS)
    for kind in KINDS:
        times = results["ttft_s"][kind]
        assert set(times) == {"256", "512"}
        assert all(isinstance(t, float) and t > 0 for t in times.values())
    for key in ("disk_bytes_per_token", "formula_bytes_per_token"):
        assert set(results[key]) == set(SETTINGS)
        assert all(value > 0 for value in results[key].values())
    # fp32: 81920-byte payloads (each source's latent and index key per `ratio` tokens)
    # and a 64-byte header per 16-token block. Release precisions: the compact records
    # without the zero padding of the pool's widest page, within the 10%.
    assert results["formula_bytes_per_token"]["tiny"] == 5120
    assert results["disk_bytes_per_token"]["tiny"] == pytest.approx((81920 + 64) / 16, rel=1e-3)
    assert results["formula_bytes_per_token"]["tiny_release_precisions"] == 712
    assert results["disk_bytes_per_token"]["tiny_release_precisions"] == pytest.approx(712, rel=0.1)
