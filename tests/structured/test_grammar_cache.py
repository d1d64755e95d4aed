"""The compiled-grammar cache only saves time, on every path that uses it (the compile
workers and the engine's xgrammar backend): a disk that cannot take a grammar leaves the
grammar usable, no temporary file behind and one warning, however many grammars miss it;
a cache file cut short or corrupt is a miss, removed and replaced by the compile."""

import os

import pytest
import xgrammar as xgr

from helpers import full_filesystem, logged_records
from vllm_deepinfer.structured import grammar_cache
from vllm_deepinfer.structured.grammar_cache import CachingCompiler

pytestmark = pytest.mark.unit


def _compiler(directory) -> CachingCompiler:
    """The cache in front of a compiler over one token per byte (milliseconds a grammar)."""
    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"</s>"], stop_token_ids=[256])
    return CachingCompiler(xgr.GrammarCompiler(info, max_threads=1), str(directory))


def _accepts(compiled, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


def test_a_full_disk_costs_compile_time_only(tmp_path):
    with (
        full_filesystem(tmp_path / "full") as directory,
        logged_records(grammar_cache.logger) as records,
    ):
        compiler = _compiler(directory)
        patterns = ["(yes|no)", "[0-9]{3}", "(yes|no)"]
        grammars = [compiler.compile_regex(pattern) for pattern in patterns]
        assert os.listdir(directory) == []  # no grammar and no temporary file
    assert [_accepts(g, "yes") for g in grammars] == [True, False, True]
    assert _accepts(grammars[1], "123")
    assert (compiler.stats.compiles, compiler.stats.hits) == (3, 0)
    warnings = [r.getMessage() for r in records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "cannot store compiled grammars" in warnings[0], warnings


@pytest.mark.parametrize("damage", ["cut short", "not JSON", "not UTF-8", "empty"])
def test_a_damaged_cache_file_is_a_miss_and_is_replaced(damage, tmp_path):
    compiler = _compiler(tmp_path)
    compiler.compile_regex("(yes|no)")
    (path,) = tmp_path.iterdir()
    whole = path.read_bytes()
    path.write_bytes(
        {
            "cut short": whole[: len(whole) // 2],
            "not JSON": b"{]",
            "not UTF-8": b"\xff\xfe\x00",
            "empty": b"",
        }[damage]
    )

    again = _compiler(tmp_path)
    with logged_records(grammar_cache.logger) as records:
        grammar = again.compile_regex("(yes|no)")
    assert _accepts(grammar, "no")
    assert (again.stats.compiles, again.stats.hits) == (1, 0)
    assert [r.levelname for r in records] == ["WARNING"]
    assert "cannot be read" in records[0].getMessage()
    later = _compiler(tmp_path)  # the compile replaced the file
    assert _accepts(later.compile_regex("(yes|no)"), "yes") and later.stats.hits == 1
