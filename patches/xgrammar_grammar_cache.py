"""vLLM's xgrammar backend compiles every grammar itself, inside the engine core. This puts
the plugin's on-disk grammar cache in front of its compiler, so grammars the plugin's
compile workers prepared outside the engine are deserialized instead of compiled.

Relies on: `XgrammarBackend` being a dataclass whose `__post_init__(self)` creates the
backend's `self.compiler`, through which `compile_grammar` compiles. Without it the engine
compiles grammars itself (correct, only slower on first use). Can go when vLLM's
structured-output backends accept an external compiled-grammar cache."""
from __future__ import annotations

import dataclasses
import re

from vllm_deepinfer.patches.base import PatchUnavailable, parameter_names, source_of

UPSTREAM = "vllm.v1.structured_output.backend_xgrammar.XgrammarBackend.__post_init__"
_MARK = "_deepinfer_grammar_cache"
_SETS_COMPILER = re.compile(r"self\.compiler\s*=")
_USES_COMPILER = re.compile(r"self\.compiler\.compile_")


def check_upstream():
    """Returns XgrammarBackend; raises PatchUnavailable when `__post_init__` or the
    `compiler` attribute it sets are not there as this patch expects."""
    try:
        from vllm.v1.structured_output import backend_xgrammar
    except ImportError as exc:
        raise PatchUnavailable("vllm.v1.structured_output.backend_xgrammar cannot be imported "
                               f"({exc})") from exc
    backend = getattr(backend_xgrammar, "XgrammarBackend", None)
    if backend is None:
        raise PatchUnavailable("vllm.v1.structured_output.backend_xgrammar.XgrammarBackend "
                               "is missing")
    post_init = backend.__dict__.get("__post_init__")
    if post_init is None:
        raise PatchUnavailable(f"{UPSTREAM} is missing")
    if not dataclasses.is_dataclass(backend):
        raise PatchUnavailable("XgrammarBackend is no longer a dataclass, so nothing calls "
                               "its __post_init__")
    params = parameter_names(post_init)
    if params != ["self"]:
        raise PatchUnavailable(f"{UPSTREAM} now takes ({', '.join(params)}), not (self)")
    if not _SETS_COMPILER.search(source_of(post_init, UPSTREAM)):
        raise PatchUnavailable(f"{UPSTREAM} no longer sets self.compiler, the compiler this "
                               "patch puts the cache in front of")
    compile_grammar = getattr(backend, "compile_grammar", None)
    if compile_grammar is None or not _USES_COMPILER.search(
            source_of(compile_grammar, "XgrammarBackend.compile_grammar")):
        raise PatchUnavailable("XgrammarBackend.compile_grammar no longer compiles through "
                               "self.compiler")
    return backend


def apply(cache_dir: str) -> bool:
    """Idempotent; returns True once the wrapper is installed."""
    backend = check_upstream()

    from vllm_deepinfer.structured.grammar_cache import CachingCompiler

    if getattr(backend.__post_init__, _MARK, False):
        return True
    original = backend.__post_init__

    def post_init(self) -> None:
        original(self)
        self.compiler = CachingCompiler(self.compiler, cache_dir)

    setattr(post_init, _MARK, True)
    post_init.__wrapped__ = original  # detection reads upstream through it
    backend.__post_init__ = post_init
    return True
