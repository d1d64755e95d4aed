"""A compiled model's cache loads on the CPU: a second start does not compile again.

Why: vLLM saves every compiled model (AOT compile) and, on the next start with the same
model and settings, loads it and calls `finalize_loading` on the loaded function's
compiled callable. That method belongs to vLLM's own backend's functions; on the CPU the
model is compiled by Inductor directly, whose callable has none, so every load fails
("'function' object has no attribute 'finalize_loading'") and the model is compiled from
scratch at every start, vLLM's own models included. Such a callable has nothing to
finalize: the patch gives it a method that does nothing, so the load goes through.

Upstream symbols: vllm.compilation.decorators._try_load_aot_compiled_fn (loads with
`torch.compiler.load_compiled_function`, then calls `finalize_loading` unconditionally);
the patch wraps `torch.compiler.load_compiled_function`, on the CPU platform only;
written against vLLM 0.32 and torch 2.13.

Remove when: vLLM checks for `finalize_loading` (or wraps Inductor's callable in its own
serializable function) on the CPU."""

from __future__ import annotations

import functools

from vllm_deepinfer.patches.base import PatchUnavailable, installed, source_of

UPSTREAM = "vllm.compilation.decorators._try_load_aot_compiled_fn"
_MARK = "_deepinfer_cpu_compile_cache"


def check_upstream():
    try:
        import torch.compiler
        from vllm.compilation import decorators
    except ImportError as exc:
        raise PatchUnavailable(f"vllm.compilation.decorators cannot be imported ({exc})") from exc
    loader = getattr(decorators, "_try_load_aot_compiled_fn", None)
    if loader is None:
        raise PatchUnavailable(f"{UPSTREAM} is missing")
    source = source_of(loader, UPSTREAM)
    for needed in ("load_compiled_function", "finalize_loading"):
        if needed not in source:
            raise PatchUnavailable(f"{UPSTREAM} no longer calls {needed}")
    if not callable(getattr(torch.compiler, "load_compiled_function", None)):
        raise PatchUnavailable("torch.compiler.load_compiled_function is missing")
    return torch.compiler


def _nothing_to_finalize(vllm_config) -> None:
    """Inductor's compiled callable is whole once loaded."""


def apply() -> bool:
    """Idempotent; True once installed."""
    compiler = check_upstream()
    original = compiler.load_compiled_function
    if installed(original, _MARK):
        return True

    @functools.wraps(original)
    def load_compiled_function(*args, **kwargs):
        loaded = original(*args, **kwargs)
        compiled = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
        if compiled is not None and not hasattr(compiled, "finalize_loading"):
            try:
                compiled.finalize_loading = _nothing_to_finalize
            except AttributeError:
                pass  # not ours to complete: vLLM's load fails and compiles, as before
        return loaded

    setattr(load_compiled_function, _MARK, True)
    compiler.load_compiled_function = load_compiled_function
    return True
