"""The shutdown and orphaned_processes patches' upstream, as vLLM wrote it, for each of
their tests."""

import os

import pytest

_GRACE = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
_SHUTDOWN_MARKS = (
    "_deepinfer_shutdown_processes",
    "_deepinfer_shutdown_window",
    "_deepinfer_shutdown_requests",
    "_deepinfer_shutdown_at_exit",
    "_deepinfer_orphaned_processes",
)


def _upstream(method):
    """`method` without the shutdown and orphaned_processes patches' wrappers (an engine
    started earlier in this process installed them)."""
    while any(getattr(method, mark, False) for mark in _SHUTDOWN_MARKS):
        method = method.__wrapped__
    return method


@pytest.fixture
def shutdown_upstream(monkeypatch):
    """The methods each shutdown patch and orphaned_processes change, by patch, as upstream
    wrote them, each patch's LEFT_TO_VLLM empty, and the workers' exit grace as the
    environment has it (shutdown_processes sets a default); all put back after each test."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc
    from vllm.v1.engine.core_client import MPClient
    from vllm.v1.engine.utils import CoreEngineProcManager
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc

    from vllm_deepinfer.patches import (
        orphaned_processes,
        shutdown_at_exit,
        shutdown_processes,
        shutdown_requests,
        shutdown_window,
    )

    parts = {
        shutdown_processes: (
            (WorkerProc, "worker_busy_loop"),
            (WorkerProc, "shutdown"),
            (EngineCoreProc, "run_busy_loop"),
            (DPEngineCoreProc, "run_busy_loop"),
            (EngineCoreProc, "shutdown"),
            (DPEngineCoreProc, "shutdown"),
        ),
        shutdown_window: ((CoreEngineProcManager, "shutdown"),),
        shutdown_requests: (
            (AsyncLLM, "shutdown"),
            (AsyncLLM, "_add_request"),
            (CoreEngineProcManager, "shutdown"),
            (GenerateBaseServing, "_raise_if_error"),
        ),
        shutdown_at_exit: ((MPClient, "__init__"),),
        orphaned_processes: (
            (MultiprocExecutor, "_init_executor"),
            (EngineCoreProc, "run_busy_loop"),
            (DPEngineCoreProc, "run_busy_loop"),
        ),
    }
    for module, methods in parts.items():
        monkeypatch.setattr(module, "LEFT_TO_VLLM", "")
        for cls, name in methods:
            monkeypatch.setattr(cls, name, _upstream(getattr(cls, name)))
    monkeypatch.setenv(_GRACE, os.environ.get(_GRACE, ""))
    if not os.environ[_GRACE]:
        monkeypatch.delenv(_GRACE)
    return parts
