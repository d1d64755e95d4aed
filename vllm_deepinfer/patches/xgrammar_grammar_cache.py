"""vLLM's xgrammar backend compiles every grammar itself, inside the engine core. This puts
the plugin's on-disk grammar cache in front of its compilers, so grammars the plugin's
compile workers prepared outside the engine are deserialized instead of compiled.

Relies on: `XgrammarBackend` being a dataclass whose `__post_init__(self)` sets the
`xgr.GrammarCompiler`s that `compile_grammar` compiles through (0.32 one, `compiler`;
0.33 a second, `full_vocab_compiler`, for structural tags and lark grammars): each such
attribute is wrapped, whatever its name. Without it the engine compiles grammars itself
(correct, only slower on first use). Can go when vLLM's structured-output backends accept
an external compiled-grammar cache."""

from __future__ import annotations

import dataclasses
import re

from vllm_deepinfer.patches.base import PatchUnavailable, parameter_names, source_of
from vllm_deepinfer.structured.grammar_cache import STATS_ATTRIBUTE

UPSTREAM = "vllm.v1.structured_output.backend_xgrammar.XgrammarBackend.__post_init__"
_MARK = "_deepinfer_grammar_cache"
_SETS_ATTRIBUTE = re.compile(r"self\.(\w+)\s*=(?!=)")
_PROBES = (
    ("JSON", '{"type": "object"}'),
    ("GRAMMAR", 'root ::= "a"'),
    (
        "STRUCTURAL_TAG",
        '{"type": "structural_tag", "format": {"type": "const_string", "value": "a"}}',
    ),
)
"""A constraint of each kind the plugin sends, for `compile_grammar` to compile; regex
left out: 0.33 compiles it on a thread pool of its own, which a failed compile leaves."""
"""The backend's CacheStats, which all its caching compilers count in."""


class _CompiledThrough(Exception):
    def __init__(self, attribute: str):
        super().__init__(attribute)
        self.attribute = attribute


class _StandIn:
    """Any attribute of the probe backend: a compile call through it stops
    `compile_grammar`, naming the attribute."""

    def __init__(self, attribute: str):
        self._attribute = attribute

    def __getattr__(self, name):
        if not name.startswith("compile_"):
            raise AttributeError(name)

        def compile_(*args, **kwargs):
            raise _CompiledThrough(self._attribute)

        return compile_


def _compiles_through_post_init_attributes(backend, post_init) -> None:
    """Behaviour, not text: `compile_grammar`, on a backend whose every attribute is a
    stand-in, must compile each kind of constraint through an attribute `__post_init__`
    sets (those the wrapper puts the cache in front of)."""
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    sets = set(_SETS_ATTRIBUTE.findall(source_of(post_init, UPSTREAM)))
    probe = type(
        "XgrammarBackendProbe",
        (backend,),
        {"__getattr__": lambda self, attribute: _StandIn(attribute)},
    )
    stub = object.__new__(probe)
    for kind, spec in _PROBES:
        try:
            backend.compile_grammar(stub, StructuredOutputOptions[kind], spec)
        except _CompiledThrough as through:
            if through.attribute not in sets:
                raise PatchUnavailable(
                    f"{UPSTREAM} no longer sets self.{through.attribute}, "
                    f"the compiler compile_grammar compiles {kind} "
                    "constraints with"
                ) from None
            continue
        except Exception as exc:  # noqa: BLE001 - any other outcome: not as expected
            raise PatchUnavailable(
                f"XgrammarBackend.compile_grammar no longer compiles {kind} "
                f"constraints through a compiler attribute "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        raise PatchUnavailable(
            f"XgrammarBackend.compile_grammar compiled a {kind} "
            "constraint without a compiler attribute"
        )


def check_upstream():
    """Returns XgrammarBackend; raises PatchUnavailable when `__post_init__` or the
    compilers it sets are not there as this patch expects."""
    try:
        from vllm.v1.structured_output import backend_xgrammar
    except ImportError as exc:
        raise PatchUnavailable(
            f"vllm.v1.structured_output.backend_xgrammar cannot be imported ({exc})"
        ) from exc
    backend = getattr(backend_xgrammar, "XgrammarBackend", None)
    if backend is None:
        raise PatchUnavailable(
            "vllm.v1.structured_output.backend_xgrammar.XgrammarBackend is missing"
        )
    post_init = backend.__dict__.get("__post_init__")
    if post_init is None:
        raise PatchUnavailable(f"{UPSTREAM} is missing")
    if not dataclasses.is_dataclass(backend):
        raise PatchUnavailable(
            "XgrammarBackend is no longer a dataclass, so nothing calls its __post_init__"
        )
    params = parameter_names(post_init)
    if params != ["self"]:
        raise PatchUnavailable(f"{UPSTREAM} now takes ({', '.join(params)}), not (self)")
    if getattr(backend, "compile_grammar", None) is None:
        raise PatchUnavailable("XgrammarBackend.compile_grammar is missing")
    _compiles_through_post_init_attributes(backend, post_init)
    return backend


def apply(cache_dir: str) -> bool:
    """Idempotent; returns True once the wrapper is installed."""
    backend = check_upstream()

    from vllm_deepinfer.structured.grammar_cache import cache_compilers

    if getattr(backend.__post_init__, _MARK, False):
        return True
    original = backend.__post_init__

    def post_init(self) -> None:
        original(self)
        setattr(self, STATS_ATTRIBUTE, cache_compilers(self, cache_dir))

    setattr(post_init, _MARK, True)
    post_init.__wrapped__ = original  # detection reads upstream through it
    backend.__post_init__ = post_init
    return True
