"""Forced tool calls through vLLM's own xgrammar backend, made as the engine makes it for
the tiny checkpoint (its config, its tokenizer): the constraint is compiled over whatever
vocabulary the installed vLLM gives that kind of constraint (0.33 blanks every special
token for grammars, keeps them for structural tags), and a call is walked through vLLM's
grammar token by token. The DSML markup must be the `｜DSML｜` token, the invoke markup of
the plugin and the parameter markup of xgrammar's `deepseek_v4_1_xml` style alike; its
plain-text spelling is refused.

With the grammar cache in front (patches/xgrammar_grammar_cache.py), every compiler the
backend builds is cached, each under its own vocabulary: what a compile worker's backend
stores is what the engine's loads, and one vocabulary's grammar is never served to the
other."""

import inspect
import re

import deepseek_recipe as dr
import pytest
import xgrammar as xgr
from test_forced_tool_calls import CALL, CALLS_END, constraint
from vllm.v1.structured_output.request import get_structured_output_key

from vllm_deepinfer.patches import xgrammar_grammar_cache
from vllm_deepinfer.patches.base import PatchUnavailable
from vllm_deepinfer.serving.prompts import PromptEncoder
from vllm_deepinfer.serving.tool_choice import DSML, forced_tool_call
from vllm_deepinfer.structured import compile_pool
from vllm_deepinfer.structured.compile_pool import xgrammar_backend
from vllm_deepinfer.structured.grammar_cache import CachingCompiler

pytestmark = [pytest.mark.unit, pytest.mark.engine_config]
PARAMETER_MARKUP = " parameter"
"""What follows `｜DSML｜` in the markup xgrammar's argument style writes."""


@pytest.fixture(scope="module")
def vllm_config(tiny_checkpoint):
    from vllm.config import ModelConfig, VllmConfig

    from vllm_deepinfer.model.deepseek_v41.registration import register_deepseek_v41

    register_deepseek_v41()
    return VllmConfig(model_config=ModelConfig(model=tiny_checkpoint, max_model_len=512))


@pytest.fixture(scope="module")
def backend(vllm_config):
    return xgrammar_backend(vllm_config)


@pytest.fixture
def cached_backend(vllm_config, monkeypatch, tmp_path):
    """Makes backends as the engine and the compile workers do, the cache (in tmp_path)
    in front of their compilers."""
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    monkeypatch.setattr(
        XgrammarBackend, "__post_init__", inspect.unwrap(XgrammarBackend.__post_init__)
    )
    assert xgrammar_grammar_cache.apply(str(tmp_path))
    return lambda: xgrammar_backend(vllm_config)


@pytest.fixture(scope="module")
def encoder(tiny_checkpoint) -> PromptEncoder:
    return PromptEncoder(tiny_checkpoint)


def dsml_spans(text: str, plain_text) -> tuple[list, list]:
    """Where `text` holds `｜DSML｜`: as the special token, and spelled as plain text (those
    followed by what `plain_text` accepts, as a model could write them)."""
    spans = [(m.start(), m.end()) for m in re.finditer(re.escape(DSML), text)]
    plain = [span for span in spans if plain_text(text[span[1] :])]
    return [span for span in spans if span not in plain], plain


def forced_call(encoder: PromptEncoder):
    """The constraint of a forced call (tool_choice required)."""
    return forced_tool_call(constraint("required"), encoder.recipe_tokenizer, {})


def accepted(backend, encoder: PromptEncoder, ids: list[int]) -> list[int]:
    """The prefix of `ids` and the end of the answer that vLLM's grammar for a forced
    call accepts."""
    grammar = backend.compile_grammar(*get_structured_output_key(forced_call(encoder)))
    return grammar.validate_tokens([*ids, encoder.token_id(dr.SpecialToken.Eos.default_str())])


def call_ids(encoder: PromptEncoder) -> list[int]:
    text = CALL + CALLS_END
    return encoder.encode_rendered(text, dsml_spans(text, lambda after: False)[0])


def test_a_call_in_dsml_tokens_is_accepted_to_the_end(backend, encoder):
    ids = call_ids(encoder)
    assert accepted(backend, encoder, ids)[:-1] == ids


@pytest.mark.parametrize(
    "plain_text",
    [
        lambda after: True,  # all the markup
        lambda after: after.startswith(PARAMETER_MARKUP),  # the arguments' markup only
    ],
    ids=["all the markup", "the parameter markup"],
)
def test_dsml_spelled_as_text_is_refused(backend, encoder, plain_text):
    text = CALL + CALLS_END
    tokens, plain = dsml_spans(text, plain_text)
    prefix = accepted(backend, encoder, encoder.encode_rendered(text, tokens))
    assert len(backend.tokenizer.decode(prefix)) <= plain[0][0]  # refused there


def test_every_compiler_of_the_backend_is_cached_under_its_own_vocabulary(cached_backend):
    backend = cached_backend()
    assert not [
        name for name, value in vars(backend).items() if isinstance(value, xgr.GrammarCompiler)
    ]
    compilers = list(
        {
            id(value): value
            for value in vars(backend).values()
            if isinstance(value, CachingCompiler)
        }.values()
    )
    fingerprints = {c.cache.tokenizer_fingerprint for c in compilers}
    assert compilers and len(fingerprints) == len(compilers)
    # The same grammar, compiled by each compiler: none is served another's.
    for compiler in compilers:
        compiler.compile_grammar('root ::= "a"')
    stats = getattr(backend, xgrammar_grammar_cache.STATS_ATTRIBUTE)
    assert (stats.compiles, stats.hits) == (len(compilers), 0)


def test_a_forced_call_compiled_by_a_worker_is_loaded_by_the_engine(
    cached_backend, encoder, monkeypatch
):
    """The worker's backend stores the grammar of the compiler the engine will use (on
    0.33 the full-vocabulary one), and the engine's loads it, DSML token and all."""
    monkeypatch.setattr(compile_pool, "_worker_backend", cached_backend())
    assert not compile_pool._compile(forced_call(encoder)).cached
    assert compile_pool._compile(forced_call(encoder)).cached
    engine = cached_backend()
    ids = call_ids(encoder)
    assert accepted(engine, encoder, ids)[:-1] == ids
    stats = getattr(engine, xgrammar_grammar_cache.STATS_ATTRIBUTE)
    assert (stats.compiles, stats.hits) == (0, 1)


def test_a_compiler_post_init_does_not_set_turns_the_cache_off(monkeypatch, tmp_path):
    """The guard runs `compile_grammar`: a compiler it uses that `__post_init__` does not
    set (made later, where the wrapper cannot see it) would go uncached."""
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    upstream = XgrammarBackend.compile_grammar

    def compile_grammar(self, request_type, grammar_spec, stop_token_ids=None):
        if request_type == StructuredOutputOptions.STRUCTURAL_TAG:
            return self.tag_compiler.compile_structural_tag(grammar_spec)
        return upstream(self, request_type, grammar_spec, stop_token_ids)

    monkeypatch.setattr(XgrammarBackend, "compile_grammar", compile_grammar)
    with pytest.raises(
        PatchUnavailable,
        match="no longer sets self.tag_compiler, the compiler compile_grammar compiles STRUCTURAL",
    ):
        xgrammar_grammar_cache.apply(str(tmp_path))
