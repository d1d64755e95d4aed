"""`deepinfer serve` as a benchmark starts and stops it: in its own process group on a free
local port, its output in a log file, healthy or an error that points at the log."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys

STARTUP_TIMEOUT_S = 900
"""A compiled first start of the tiny model takes about two minutes on a quiet 2-core
machine; a loaded one takes several times that."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    model: str,
    serve_args: list[str],
    env: dict[str, str],
    log_path: str,
    base_environment: dict[str, str] | None = None,
    timeout_s: float = STARTUP_TIMEOUT_S,
) -> tuple[subprocess.Popen, str]:
    """`deepinfer serve MODEL --host 127.0.0.1 --port P *serve_args` with `env` over
    `base_environment` (this process's environment by default); (the process, its base
    URL) once /health answers within `timeout_s`."""
    from vllm_deepinfer.serving.health import wait_until_healthy

    port = free_port()
    command = [sys.executable, "-m", "vllm_deepinfer.serving.cli", "serve", model]
    command += ["--host", "127.0.0.1", "--port", str(port), *serve_args]
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**(os.environ if base_environment is None else base_environment), **env},
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    failure = wait_until_healthy(base, server, timeout_s)
    if failure:
        stop(server)
        raise RuntimeError(f"{failure}; see {log_path}")
    return server, base


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL past 60 s; a group already gone (a
    server that exited) is left alone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
