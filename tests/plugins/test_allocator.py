"""allocator.py: tcmalloc goes first into LD_PRELOAD for vLLM's processes, once, unless
DEEPINFER_TCMALLOC=off or the machine has none."""
import pytest

from vllm_deepinfer import allocator
from vllm_deepinfer.envs import ConfigError

pytestmark = pytest.mark.unit


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.setattr(allocator, "tcmalloc_library", lambda: "libtcmalloc_minimal.so.4")


def test_tcmalloc_goes_first_for_the_processes_started_later(installed):
    environ = {"LD_PRELOAD": "/opt/libgomp.so"}
    assert allocator.preload_for_children(environ) is True
    assert environ["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:/opt/libgomp.so"
    assert allocator.preload_for_children(environ) is False  # once
    assert environ["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:/opt/libgomp.so"


def test_off_or_missing_leaves_the_environment_alone(installed, monkeypatch):
    environ = {"DEEPINFER_TCMALLOC": "off"}
    assert allocator.preload_for_children(environ) is False and "LD_PRELOAD" not in environ
    monkeypatch.setattr(allocator, "tcmalloc_library", lambda: None)
    environ = {}
    assert allocator.preload_for_children(environ) is False and environ == {}


def test_a_bad_switch_is_refused_by_name():
    with pytest.raises(ConfigError, match="DEEPINFER_TCMALLOC"):
        allocator.preload_for_children({"DEEPINFER_TCMALLOC": "maybe"})


def test_the_system_library_is_found_where_installed():
    import ctypes

    library = allocator.tcmalloc_library()
    if library is None:
        pytest.skip("no system tcmalloc on this machine")
    ctypes.CDLL(library)  # loadable by the name LD_PRELOAD gets
