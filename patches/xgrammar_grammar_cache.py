"""vLLM's xgrammar backend compiles every grammar itself, inside the engine core. This puts
the plugin's on-disk grammar cache in front of its compiler, so grammars the plugin's
compile workers prepared outside the engine are deserialized instead of compiled."""
from __future__ import annotations

SUPPORTED_VLLM = ("0.32.",)
_MARK = "_deepinfer_grammar_cache"


def apply(cache_dir: str) -> bool:
    """Idempotent; returns whether the wrapper is installed."""
    import vllm
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    from vllm_deepinfer.structured.grammar_cache import CachingCompiler

    if getattr(XgrammarBackend.__post_init__, _MARK, False):
        return True
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise RuntimeError(f"patch xgrammar_grammar_cache was written for vLLM {SUPPORTED_VLLM}, "
                           f"found {vllm.__version__}; re-check backend_xgrammar.py")
    original = XgrammarBackend.__post_init__

    def post_init(self) -> None:
        original(self)
        self.compiler = CachingCompiler(self.compiler, cache_dir)

    setattr(post_init, _MARK, True)
    XgrammarBackend.__post_init__ = post_init
    return True
