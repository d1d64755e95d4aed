"""Registration of the structured-output pieces (called by the general plugin)."""
from vllm_deepinfer import envs


def register_grammar_cache() -> None:
    """Grammars compiled outside the engine reach vLLM's xgrammar backend (any model)."""
    from vllm_deepinfer.patches import xgrammar_grammar_cache

    xgrammar_grammar_cache.apply(envs.load().grammar_cache_dir)
