"""`deepinfer serve --speculative-config '{"method": "dspark", ...}'`: the engine core runs
in its own process, so DSpark's counts cross the typed output encoding
(patches/dspark_stats.py) on their way to /metrics."""
import json
import time

import pytest
import requests
from helpers import SERVED_NAME, serve

pytestmark = pytest.mark.server


def scrape(base: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in requests.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("deepinfer:spec_decode") and "_total" in line:
            name = line.split("{")[0].split(" ")[0]
            values[name] = values.get(name, 0.0) + float(line.split()[-1])
    return values


def test_dspark_counters_reach_metrics(tiny_checkpoint, tmp_path):
    spec = json.dumps({"method": "dspark", "num_speculative_tokens": 5})
    with serve(tiny_checkpoint, tmp_path, "--speculative-config", spec,
               "--max-num-seqs", "4") as base:
        reply = requests.post(f"{base}/v1/completions", timeout=120, json={
            "model": SERVED_NAME, "prompt": "The quick brown fox jumps over", "max_tokens": 24,
            "temperature": 0.0, "ignore_eos": True}).json()
        assert reply["usage"]["completion_tokens"] == 24, reply
        for _ in range(50):  # counted when the engine's stats arrive
            values = scrape(base)
            if values.get("deepinfer:spec_decode_calibrated_drafts_total", 0) > 0:
                break
            time.sleep(0.1)
    assert values["deepinfer:spec_decode_proposed_tokens_total"] >= 5 * 10
    assert 0 < values["deepinfer:spec_decode_verified_tokens_total"] <= \
        values["deepinfer:spec_decode_proposed_tokens_total"]
    assert values["deepinfer:spec_decode_calibrated_drafts_total"] > 0
    assert 0 < values["deepinfer:spec_decode_confidence_sum_total"] <= \
        values["deepinfer:spec_decode_calibrated_drafts_total"]
