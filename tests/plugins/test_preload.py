"""preload.py: tcmalloc and Intel's OpenMP go into LD_PRELOAD for vLLM's processes, once,
tcmalloc first and the OpenMP runtime last, unless switched off, already chosen by the
user or not installed."""

import pytest

from vllm_deepinfer import preload
from vllm_deepinfer.envs import ConfigError

pytestmark = pytest.mark.unit

TCMALLOC, IOMP = "libtcmalloc_minimal.so.4", "/venv/lib/libiomp5.so"


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.setattr(preload, "tcmalloc_library", lambda: TCMALLOC)
    monkeypatch.setattr(preload, "iomp_library", lambda: IOMP)


def test_both_go_first_for_the_processes_started_later(installed):
    environ = {"LD_PRELOAD": "/opt/libfoo.so"}
    assert preload.preload_for_children(environ) is True
    assert environ["LD_PRELOAD"] == f"{TCMALLOC}:/opt/libfoo.so:{IOMP}"
    assert preload.preload_for_children(environ) is False  # once
    assert environ["LD_PRELOAD"] == f"{TCMALLOC}:/opt/libfoo.so:{IOMP}"


def test_an_openmp_runtime_the_user_preloaded_is_kept(installed):
    environ = {"LD_PRELOAD": "/torch/lib/libgomp.so.1"}
    assert preload.preload_for_children(environ) is True
    assert environ["LD_PRELOAD"] == f"{TCMALLOC}:/torch/lib/libgomp.so.1"


@pytest.mark.parametrize(
    "switches,expected",
    [
        ({"DEEPINFER_TCMALLOC": "off"}, IOMP),
        ({"DEEPINFER_IOMP": "off"}, TCMALLOC),
    ],
)
def test_each_can_be_left_out(installed, switches, expected):
    environ = dict(switches)
    assert preload.preload_for_children(environ) is True
    assert environ["LD_PRELOAD"] == expected


def test_off_or_missing_leaves_the_environment_alone(installed, monkeypatch):
    environ = {"DEEPINFER_TCMALLOC": "off", "DEEPINFER_IOMP": "0"}
    assert preload.preload_for_children(environ) is False and "LD_PRELOAD" not in environ
    monkeypatch.setattr(preload, "tcmalloc_library", lambda: None)
    monkeypatch.setattr(preload, "iomp_library", lambda: None)
    environ = {}
    assert preload.preload_for_children(environ) is False and environ == {}


@pytest.mark.parametrize("name", ["DEEPINFER_TCMALLOC", "DEEPINFER_IOMP"])
def test_a_bad_switch_is_refused_by_name(name):
    with pytest.raises(ConfigError, match=name):
        preload.preload_for_children({name: "maybe"})


@pytest.mark.parametrize(
    "find", [preload.tcmalloc_library, preload.iomp_library], ids=["tcmalloc", "iomp"]
)
def test_the_installed_library_is_found_and_loads(find):
    import ctypes

    library = find()
    if library is None:
        pytest.skip("not installed on this machine")
    ctypes.CDLL(library)  # loadable by the name LD_PRELOAD gets
