"""The shutdown_window patch: its probe (upstream's own process manager run on a stand-in
process), its guard, and its wrapper. The server-level behaviour is
tests/serving/test_shutdown.py."""

import pytest
from shutdown_parts import EngineProcManagerStandIn, installed

from vllm_deepinfer.patches import shutdown_processes, shutdown_requests, shutdown_window
from vllm_deepinfer.patches.base import PatchUnavailable

pytestmark = pytest.mark.unit

_GRACE = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"


def _vllm_033_window(request_timeout, process_timeout):
    """vLLM 0.33's get_engine_process_shutdown_timeout on the CPU: a set
    VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS becomes the window after the abort."""
    import os

    import vllm.envs as envs

    if request_timeout == 0 and process_timeout == 0 and _GRACE in os.environ:
        return float(envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS)
    return process_timeout


def _apply_all() -> list[bool]:
    """As register() applies them: the processes' part first (it sets the workers' grace
    the window counts)."""
    return [shutdown_processes.apply(), shutdown_window.apply(), shutdown_requests.apply()]


def test_applies_on_this_vllm_and_is_idempotent(shutdown_upstream):
    """Upstream's window, where it grants one on the CPU, is shorter than the patch's: the
    probe finds this vLLM's process manager waits nothing in abort mode."""
    from vllm.v1.engine.utils import CoreEngineProcManager

    upstream = shutdown_window._check_upstream()
    assert shutdown_window.upstream_window_s(upstream) == 0
    assert _apply_all() == [True, True, True]
    assert installed(shutdown_upstream, shutdown_window)
    assert shutdown_window.LEFT_TO_VLLM == ""
    wrapper = CoreEngineProcManager.shutdown
    assert shutdown_window.apply()
    assert CoreEngineProcManager.shutdown is wrapper


@pytest.mark.parametrize(
    "upstream_window,waited",
    [
        (lambda request, process: 0, 0),
        (lambda request, process: None, 5.0),
        (lambda request, process: 15.0, 15.0),
        (lambda request, process: 34.0, 34.0),
    ],
    ids=["zero", "none-is-5s", "15s", "34s"],
)
def test_the_probe_reads_how_long_upstreams_manager_waits(
    upstream_window, waited, shutdown_upstream, monkeypatch
):
    """Through upstream's own CoreEngineProcManager.shutdown and process shutdown helper,
    on a stand-in process that is never killed."""
    from vllm.v1.engine import utils

    monkeypatch.setattr(utils, "get_engine_process_shutdown_timeout", upstream_window)
    assert shutdown_window.upstream_window_s(shutdown_window._check_upstream()) == waited


@pytest.mark.parametrize("set_by_user", [None, "5", "7", "15"])
def test_applies_where_the_workers_grace_is_set(set_by_user, shutdown_upstream, monkeypatch):
    """vLLM 0.33 returns a set VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS as its window on every
    platform: the workers' grace alone, set by the user or by shutdown_processes' default
    (None). That is no teardown window: the patch keeps its own, and the others apply."""
    from vllm.v1.engine import utils

    if set_by_user is not None:
        monkeypatch.setenv(_GRACE, set_by_user)
    monkeypatch.setattr(utils, "get_engine_process_shutdown_timeout", _vllm_033_window)
    assert _apply_all() == [True, True, True]
    assert all(
        installed(shutdown_upstream, module)
        for module in (shutdown_processes, shutdown_window, shutdown_requests)
    )
    assert shutdown_window.LEFT_TO_VLLM == ""


def test_applies_with_this_vllms_window_and_a_users_grace(shutdown_upstream, monkeypatch):
    """As above, through the installed vLLM's own get_engine_process_shutdown_timeout."""
    monkeypatch.setenv(_GRACE, "7")
    assert _apply_all() == [True, True, True]
    assert installed(shutdown_upstream, shutdown_window)


@pytest.mark.parametrize(
    "upstream_window",
    [lambda: 0, lambda: None, lambda: 15.0, lambda: shutdown_window.teardown_window_s() - 1],
    ids=["zero", "none", "15s", "just-short"],
)
def test_keeps_its_window_where_upstreams_is_shorter(
    upstream_window, shutdown_upstream, monkeypatch
):
    from vllm.v1.engine import utils

    monkeypatch.setattr(
        utils, "get_engine_process_shutdown_timeout", lambda request, process: upstream_window()
    )
    assert _apply_all() == [True, True, True]
    assert installed(shutdown_upstream, shutdown_window)


@pytest.mark.parametrize("longer_by", [0, 30])
def test_left_to_upstream_where_its_window_is_as_long_the_rest_applies(
    longer_by, shutdown_upstream, monkeypatch
):
    """The patch's window, as upstream's is compared with it, counts the workers' exit grace
    shutdown_processes sets first; the other patches apply all the same."""
    from vllm.v1.engine import utils

    monkeypatch.setattr(
        utils,
        "get_engine_process_shutdown_timeout",
        lambda request, process: shutdown_window.teardown_window_s() + longer_by,
    )
    assert _apply_all() == [True, False, True]
    assert not installed(shutdown_upstream, shutdown_window)
    assert installed(shutdown_upstream, shutdown_processes)
    assert installed(shutdown_upstream, shutdown_requests)
    upstream_window = shutdown_window.teardown_window_s() + longer_by
    assert shutdown_window.LEFT_TO_VLLM.startswith(
        f"waits {upstream_window:g} s for the engine core after the abort"
    )


def _manager_shutdown_not_stopping(self, timeout=None):
    pass


def _manager_shutdown_reading_another_attribute(self, timeout=None):
    self._engine_processes[0].terminate()


def _handle_shutdown_without_abort(self):
    return False


@pytest.mark.parametrize(
    "module,cls,name,replacement,reason",
    [
        (
            "vllm.v1.engine.utils",
            "CoreEngineProcManager",
            "shutdown",
            _manager_shutdown_not_stopping,
            "no longer stops the engine core process",
        ),
        (
            "vllm.v1.engine.utils",
            "CoreEngineProcManager",
            "shutdown",
            _manager_shutdown_reading_another_attribute,
            "cannot be probed on a stand-in manager .AttributeError",
        ),
        (
            "vllm.v1.engine.core",
            "EngineCoreProc",
            "_handle_shutdown",
            _handle_shutdown_without_abort,
            "no longer aborts in-flight requests",
        ),
    ],
)
def test_unavailable_when_upstream_changes(
    module, cls, name, replacement, reason, shutdown_upstream, monkeypatch
):
    import importlib

    monkeypatch.setattr(getattr(importlib.import_module(module), cls), name, replacement)
    with pytest.raises(PatchUnavailable, match=reason):
        shutdown_window.apply()
    assert not installed(shutdown_upstream, shutdown_window)


# --- the wrapper --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_timeout,timeout,expected",
    [
        (0, 0, "window"),  # abort mode: the engine core gets its teardown window
        (30, 30, 30),  # drain mode (--shutdown-timeout 30): the user's timeout
        (0, None, "window"),  # the finalizer's path: upstream's 5 s would cut the teardown
        (0, 15, "window"),  # the client's clean-up: VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS
        (0, 60, 60),  # longer than the window: kept
    ],
)
def test_manager_gets_a_window_in_abort_mode_only(request_timeout, timeout, expected, monkeypatch):
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", 5, raising=False)
    manager = EngineProcManagerStandIn(request_timeout)
    shutdown_window._wrap_manager_shutdown(EngineProcManagerStandIn.shutdown)(manager, timeout)
    assert manager.timeouts == [24.0 if expected == "window" else expected]
