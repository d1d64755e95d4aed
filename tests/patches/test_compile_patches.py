"""The two patches that let vLLM compile the plugin's V4.1 on the CPU and reuse what it
compiled: the breakable-graph architecture list no longer forces V4.1's compilation off,
and a saved compiled model's Inductor callable gets the `finalize_loading` vLLM's loader
calls. The engine-level effect (compiled by default, a second start loading the compile
cache) is tests/model/test_compiled.py."""

import inspect
from types import SimpleNamespace

import pytest
import torch.compiler
from vllm.config.vllm import VllmConfig

from vllm_deepinfer.model.deepseek_v41.registration import ARCH, is_v41
from vllm_deepinfer.patches import cpu_compile_cache, cpu_compiled_v41

pytestmark = pytest.mark.unit


def config_of(architecture: str):
    return SimpleNamespace(model_config=SimpleNamespace(architectures=[architecture]))


def test_v41_no_longer_asks_for_breakable_graphs_other_architectures_still_do(monkeypatch):
    # As upstream wrote it (register() may have wrapped it in this process already).
    upstream = inspect.unwrap(VllmConfig.__dict__["_uses_breakable_cudagraph_by_default"])
    monkeypatch.setattr(VllmConfig, "_uses_breakable_cudagraph_by_default", upstream)
    assert upstream(config_of(ARCH)) and upstream(config_of("DeepseekV4ForCausalLM"))
    assert cpu_compiled_v41.apply(serves_model=is_v41)
    patched = VllmConfig._uses_breakable_cudagraph_by_default
    assert not patched(config_of(ARCH))
    assert patched(config_of("DeepseekV4ForCausalLM"))
    assert not patched(config_of("LlamaForCausalLM"))
    assert cpu_compiled_v41.apply(serves_model=is_v41)  # idempotent
    assert VllmConfig._uses_breakable_cudagraph_by_default is patched


def test_a_loaded_inductor_callable_gets_a_finalize_that_does_nothing(monkeypatch):
    def inductor_callable(*args):
        return "ran"

    class VllmSerialized:
        def __init__(self):
            self.finalized = False

        def finalize_loading(self, vllm_config):
            self.finalized = True

    loaded = []

    def load(file, f_globals=None):
        return loaded.pop(0)

    monkeypatch.setattr(torch.compiler, "load_compiled_function", load)  # over any wrapper
    assert cpu_compile_cache.apply()
    inductor = SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=inductor_callable))
    serialized = SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=VllmSerialized()))
    loaded += [inductor, serialized]
    first = torch.compiler.load_compiled_function(None)
    assert first._artifacts.compiled_fn.finalize_loading(None) is None
    assert first._artifacts.compiled_fn() == "ran"
    second = torch.compiler.load_compiled_function(None)
    second._artifacts.compiled_fn.finalize_loading(None)
    assert second._artifacts.compiled_fn.finalized  # vLLM's own method, untouched
