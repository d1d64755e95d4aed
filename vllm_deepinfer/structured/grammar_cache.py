"""Compiled grammars, serialized on disk and keyed by (compile call, tokenizer).

Any process that holds an xgrammar compiler for the same tokenizer (the plugin's compile
workers, the engine's structured-output backend) shares the cache: a constraint compiled
once is deserialized everywhere else instead of compiled again.

The cache only saves time: a grammar that cannot be stored (a full disk, no permission)
is still used, and a cache file that cannot be read (truncated, corrupt) is a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field

import xgrammar as xgr

from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)
COMPILE_METHODS = (
    "compile_json_schema",
    "compile_grammar",
    "compile_regex",
    "compile_lark",
    "compile_structural_tag",
    "compile_builtin_json_grammar",
)


@dataclass
class CacheStats:
    """Counted by every compiler of one backend, from the engine's compile threads."""

    hits: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def hit(self) -> None:
        with self._lock:
            self.hits += 1

    def compiled(self, seconds: float) -> None:
        with self._lock:
            self.compiles += 1
            self.compile_seconds += seconds


class GrammarCache:
    def __init__(self, directory: str, tokenizer_info: xgr.TokenizerInfo):
        self.directory = directory
        self.tokenizer_info = tokenizer_info
        self.tokenizer_fingerprint = hashlib.sha256(
            tokenizer_info.serialize_json().encode()
        ).hexdigest()
        self._store_failed = False
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            self._cannot_store(e)

    def key(self, method: str, args: tuple, kwargs: dict) -> str:
        call = json.dumps(
            [method, [_plain(a) for a in args], {k: _plain(v) for k, v in sorted(kwargs.items())}]
        )
        return hashlib.sha256(f"{self.tokenizer_fingerprint}\n{call}".encode()).hexdigest()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.json")

    def load(self, key: str) -> xgr.CompiledGrammar | None:
        """The cached grammar, or None: not cached, or a file that cannot be read back (cut
        short by a full disk, corrupt), which is removed so that the compile replaces it."""
        path = self._path(key)
        try:
            with open(path, encoding="utf-8") as f:
                return xgr.CompiledGrammar.deserialize_json(f.read(), self.tokenizer_info)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RuntimeError) as e:  # xgrammar's errors are RuntimeErrors
            logger.warning(
                "grammar cache: %s cannot be read (%s: %s); compiling the grammar again",
                path,
                type(e).__name__,
                e,
            )
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None

    def store(self, key: str, compiled: xgr.CompiledGrammar) -> None:
        """Written under a temporary name and renamed, so readers never see half a file.
        Where it cannot be written nothing is left behind: the grammar is only not cached."""
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(compiled.serialize_json())
            os.replace(tmp, self._path(key))
        except OSError as e:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            self._cannot_store(e)

    def _cannot_store(self, error: OSError) -> None:
        """Warns once per cache: a full disk would otherwise log it for every request."""
        if not self._store_failed:
            self._store_failed = True
            logger.warning(
                "grammar cache: cannot store compiled grammars in %s (%s); they "
                "are compiled where needed instead (this is not logged again)",
                self.directory,
                error,
            )


def _plain(value):
    """Arguments as JSON-able values (tuples become lists, enums their names)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


class CachingCompiler:
    """Stands in for an `xgr.GrammarCompiler`: a compile call is served from the cache
    when it can be, and compiled (then stored) when it cannot. The cache is keyed by the
    compiler's own vocabulary, as it compiles over it (vLLM 0.33's backend has two
    compilers over one tokenizer, one with the special tokens blanked)."""

    def __init__(
        self, compiler: xgr.GrammarCompiler, directory: str, stats: CacheStats | None = None
    ):
        self._compiler = compiler
        self.cache = GrammarCache(directory, compiler.compile_builtin_json_grammar().tokenizer_info)
        self.stats = stats or CacheStats()

    def __getattr__(self, name):
        target = getattr(self._compiler, name)
        if name not in COMPILE_METHODS:
            return target

        def compile_cached(*args, **kwargs):
            key = self.cache.key(name, args, kwargs)
            compiled = self.cache.load(key)
            if compiled is not None:
                self.stats.hit()
                return compiled
            start = time.perf_counter()
            compiled = target(*args, **kwargs)
            elapsed = time.perf_counter() - start
            self.cache.store(key, compiled)
            self.stats.compiled(elapsed)
            return compiled

        return compile_cached


STATS_ATTRIBUTE = "deepinfer_grammar_cache_stats"
"""The attribute of a cached backend holding the stats its compilers count in."""


def cache_compilers(owner, directory: str) -> CacheStats:
    """Puts the cache in front of every `xgr.GrammarCompiler` attribute of `owner` (one
    compiler under two names gets one wrapper); returns the stats they all count in."""
    stats = CacheStats()
    wrappers: dict[int, CachingCompiler] = {}
    for name, value in list(vars(owner).items()):
        if isinstance(value, xgr.GrammarCompiler):
            if id(value) not in wrappers:
                wrappers[id(value)] = CachingCompiler(value, directory, stats)
            setattr(owner, name, wrappers[id(value)])
    return stats
