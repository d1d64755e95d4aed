"""`make demo` as a user first runs it: `examples/offline_inference.py` on its default
checkpoint (written there when missing), compiled as V4.1 runs by default. It prints its
text and its speed, says how long compiling took and that the next start loads vLLM's
compile cache (or loads it), and exits 0 without a force-kill, a traceback, a warning of
an unexpected exit or a leak report (the engine is left to the interpreter's exit:
patches shutdown_at_exit and shutdown_processes)."""

import re

import pytest

from helpers import EARLY_RUNS, demo_run

pytestmark = pytest.mark.engine

# The compiled first start took 8 minutes on a loaded 2-core machine; later ones load the
# compile cache (the default checkpoint's path is part of its key, so it is kept).
DEMO_TIMEOUT_S = 1500
UNCLEAN = ("force killing", "Traceback", "leaked", "exited unexpectedly", " ERROR ")


def test_make_demo_runs_compiled_and_exits_cleanly():
    # Started at the end of collection (conftest.py), else now.
    run = (EARLY_RUNS.pop("demo", None) or demo_run()).result(timeout=DEMO_TIMEOUT_S)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    lines = log.splitlines()
    assert [line for line in lines if any(sign in line for sign in UNCLEAN)] == []
    assert len([line for line in lines if line.startswith("completion: ")]) == 4
    assert re.search(r"^128 tokens in [0-9.]+ s: [0-9.]+ tokens/s", run.stdout, re.MULTILINE)
    # Compiled: the engine's configuration line, and no "Enforce eager set" warning.
    assert "enforce_eager=False" in log and "Enforce eager set" not in log
    compiled = re.search(
        r"DeepseekV41ForCausalLM compiled in [0-9.]+ s .*: the next start "
        r"with the same model and settings loads it",
        log,
    )
    assert compiled or "Directly load AOT compilation from path" in log
