"""vLLM compiles the plugin's V4.1 on the CPU, as it compiles its own models there.

Why: `DeepseekV41ForCausalLM` is in vLLM's `DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES`
(upstream's V4.1 cannot be traced by torch.compile), so `VllmConfig` turns breakable CUDA
graphs on for it (`VLLM_USE_BREAKABLE_CUDAGRAPH=1`) and with them sets the compilation
mode to NONE, on every platform, the CPU included, where there are no CUDA graphs to
break. The plugin's model is traceable (its cache-reading parts are opaque layer ops,
model/deepseek_v41/layer_ops.py), so on the CPU the architecture no longer asks for
breakable graphs and vLLM's CPU compilation applies (`--enforce-eager` / `-O0` still run
it eager; a user's `VLLM_USE_BREAKABLE_CUDAGRAPH` still wins). GPUs keep vLLM's choice.

Upstream symbol: vllm.config.vllm.VllmConfig._uses_breakable_cudagraph_by_default (a
method deciding from `model_config.architectures`); written against vLLM 0.32.

Remove when: vLLM decides breakable graphs per platform or per model class (or leaves
the CPU's compilation alone) and the plugin's V4.1 is compiled without it."""

from __future__ import annotations

import functools
import re

from vllm_deepinfer.patches.base import PatchUnavailable, installed, parameter_names, source_of

UPSTREAM = "vllm.config.vllm.VllmConfig._uses_breakable_cudagraph_by_default"
_MARK = "_deepinfer_cpu_compiled_v41"


def check_upstream():
    try:
        from vllm.config.vllm import VllmConfig
    except ImportError as exc:
        raise PatchUnavailable(f"vllm.config.vllm.VllmConfig cannot be imported ({exc})") from exc
    method = VllmConfig.__dict__.get("_uses_breakable_cudagraph_by_default")
    if method is None or not callable(method):
        raise PatchUnavailable(f"{UPSTREAM} is missing")
    if parameter_names(method) != ["self"]:
        raise PatchUnavailable(f"{UPSTREAM} no longer takes (self)")
    if not re.search(r"\barchitectures\b", source_of(method, UPSTREAM)):
        raise PatchUnavailable(f"{UPSTREAM} no longer decides by the model's architectures")
    return VllmConfig, method


def apply(serves_model) -> bool:
    """Wraps the method on the CPU platform; `serves_model(model_config)` says whether the
    plugin's V4.1 runs. Idempotent; True once installed."""
    VllmConfig, method = check_upstream()
    if installed(method, _MARK):
        return True

    @functools.wraps(method)
    def uses_breakable_cudagraph_by_default(self) -> bool:
        if self.model_config is not None and serves_model(self.model_config):
            return False
        return method(self)

    setattr(uses_breakable_cudagraph_by_default, _MARK, True)
    VllmConfig._uses_breakable_cudagraph_by_default = uses_breakable_cudagraph_by_default
    return True
