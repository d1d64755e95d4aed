"""Whether the engine reads grammars compiled outside it: the grammar-cache patch applied or
not, per DEEPINFER_GRAMMAR_CACHE (the general plugin and the front end ask)."""

from vllm_deepinfer import envs
from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)
_skip_logged = False  # register() runs many times per process; say it once


def register_grammar_cache() -> bool:
    """Grammars compiled outside the engine reach vLLM's xgrammar backend (any model).
    False when DEEPINFER_GRAMMAR_CACHE=off, or when the patch cannot apply on this vLLM
    (warned): the engine then compiles every grammar itself, as stock vLLM does."""
    global _skip_logged
    from vllm_deepinfer import patches

    settings = envs.load()
    if not settings.grammar_cache:
        if not _skip_logged:
            _skip_logged = True
            logger.info(
                "DEEPINFER_GRAMMAR_CACHE=off: the grammar-cache patch is not applied; "
                "vLLM's xgrammar backend compiles every grammar in the engine"
            )
        return False
    return patches.apply_patch("xgrammar_grammar_cache", cache_dir=settings.grammar_cache_dir)
