"""The shutdown_at_exit patch: its guard and probe on the installed vLLM, and the order its
wrapper gives the finalizers at a real interpreter exit. End to end (an offline `LLM` left
to the interpreter's exit): tests/examples/test_offline_demo.py."""

import subprocess
import sys
import textwrap
import weakref

import pytest
from shutdown_parts import installed

from vllm_deepinfer.patches import shutdown_at_exit
from vllm_deepinfer.patches.base import PatchUnavailable


@pytest.mark.unit
def test_applies_on_this_vllm_and_is_idempotent(shutdown_upstream):
    from vllm.v1.engine.core_client import MPClient

    assert shutdown_at_exit.upstream_client_stops_first(MPClient) == ""
    assert shutdown_at_exit.apply()
    assert installed(shutdown_upstream, shutdown_at_exit)
    wrapper = MPClient.__init__
    assert shutdown_at_exit.apply()
    assert MPClient.__init__ is wrapper


def _init_registering_after_its_engines(self, vllm_config):
    from vllm.v1.engine.utils import launch_core_engines

    with launch_core_engines(vllm_config) as launch:
        self.engine_manager = launch.engine_manager
    self._finalizer = weakref.finalize(self, self.resources)  # read by the probe, never run


def _init_without_a_finalizer(self, vllm_config):
    self.engine_manager = None


@pytest.mark.unit
def test_left_to_upstream_where_the_client_registers_its_finalizer_last(
    shutdown_upstream, monkeypatch
):
    from vllm.v1.engine.core_client import MPClient

    monkeypatch.setattr(MPClient, "__init__", _init_registering_after_its_engines)
    assert shutdown_at_exit.apply() is False
    assert not installed(shutdown_upstream, shutdown_at_exit)
    assert shutdown_at_exit.LEFT_TO_VLLM.startswith("registers its engine client's finalizer after")


@pytest.mark.unit
def test_unavailable_where_the_client_no_longer_registers_one(shutdown_upstream, monkeypatch):
    from vllm.v1.engine.core_client import MPClient

    monkeypatch.setattr(MPClient, "__init__", _init_without_a_finalizer)
    with pytest.raises(PatchUnavailable, match="no longer registers a finalizer"):
        shutdown_at_exit.apply()
    assert not installed(shutdown_upstream, shutdown_at_exit)


_EXIT_ORDER = """
import weakref
from vllm_deepinfer.patches import shutdown_at_exit

def stop(what):
    print("stops", what, flush=True)

class Manager:
    pass

class Client:  # vLLM's MPClient as far as its finalizers go
    def __init__(self, name):
        self._finalizer = weakref.finalize(self, stop, name)
        self.manager = Manager()  # its engines' process manager, created after
        self.manager._finalizer = weakref.finalize(self.manager, stop, "its manager")

if {wrapped}:
    Client.__init__ = shutdown_at_exit._wrap_init(Client.__init__)
kept = Client("the client")  # never shut down: alive at interpreter exit
dropped = Client("a dropped client")
del dropped  # collected at once: its own finalizer, as before
print("exiting", flush=True)
"""


@pytest.mark.engine  # a fresh interpreter importing vLLM, twice
@pytest.mark.parametrize(
    "wrapped,order",
    [
        (False, ["stops its manager", "stops the client"]),  # upstream: the manager first
        (True, ["stops the client", "stops its manager"]),
    ],
)
def test_at_exit_the_client_stops_its_engine_before_the_manager_finalizer(wrapped, order):
    code = textwrap.dedent(_EXIT_ORDER).format(wrapped=wrapped)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[:2] == ["stops a dropped client", "stops its manager"]
    assert lines[2:] == ["exiting", *order]
