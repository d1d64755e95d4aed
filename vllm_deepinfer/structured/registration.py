"""Registration of the structured-output pieces (called by the general plugin)."""
from vllm_deepinfer import envs


def register_grammar_cache() -> bool:
    """Grammars compiled outside the engine reach vLLM's xgrammar backend (any model).
    False when the patch cannot apply on this vLLM (warned; the engine compiles itself)."""
    from vllm_deepinfer import patches

    return patches.apply_patch("xgrammar_grammar_cache", cache_dir=envs.load().grammar_cache_dir)
