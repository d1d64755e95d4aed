"""Waiting for a `deepinfer serve` someone started to answer `/health` (tests, benchmarks)."""

from __future__ import annotations

import subprocess
import time

import requests


def wait_until_healthy(base: str, process: subprocess.Popen, timeout_s: float) -> str | None:
    """None once `base` answers /health with 200; otherwise why not (the process exited,
    or the time ran out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            return f"server exited with {process.returncode}"
        try:
            if requests.get(f"{base}/health", timeout=2).status_code == 200:
                return None
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            return f"server not healthy after {timeout_s}s"
        time.sleep(0.25)
