"""The one place DEEPINFER_* environment variables are read and validated.

Every setting is parsed together by `load()`, so a bad value fails fast with a message
naming the variable, the value and what is accepted, instead of surfacing later as an
obscure error deep inside the engine.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Mapping

MODEL_IMPL_CHOICES = ("auto", "deepinfer", "vllm")
SWITCH_VALUES = {"on": True, "1": True, "off": False, "0": False}


class ConfigError(ValueError):
    """A DEEPINFER_* variable holds a value that cannot be used."""


DEFAULT_KEEP_TOKENS = 140
"""DeepInfer's default replay: the 128-token window plus room for speculative backtracking."""
EXACT_MODE = 0

DEFAULT_GRAMMAR_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "vllm_deepinfer",
                                         "grammars")


@dataclass(frozen=True)
class DeepInferSettings:
    model_impl: str = "auto"
    """Which DeepseekV41ForCausalLM serves: upstream vLLM's, the plugin's, or `auto`
    (upstream where it runs: NVIDIA/ROCm with Model Runner V2; the plugin's elsewhere)."""
    grammar_cache: bool = True
    """The precompiled-grammar cache in front of vLLM's xgrammar backend; off, the engine
    compiles every grammar itself, as stock vLLM does."""
    grammar_cache_dir: str = DEFAULT_GRAMMAR_CACHE_DIR
    """Where compiled grammars are kept, serialized, shared by every process."""
    async_scheduling: bool = True
    """Asynchronous scheduling for the plugin's V4.1 on the CPU, which vLLM's CPU platform
    otherwise forces off: the engine core schedules the next step while the worker runs
    this one."""
    yoco_prefill_keep_tokens: int = DEFAULT_KEEP_TOKENS
    """Bounded replay and decoder-side (YOCO) replay: on a prefix-cache hit the last `keep`
    tokens are recomputed with a window truncated at the replay start, and a prefill runs
    the last kv source and the layers after it only on each request's last `keep` prompt
    rows. At least the model's sliding window; 0 (or `off`) turns both off (exact mode:
    every cache is kept and nothing is replayed)."""
    enable_mtp_varlen: bool = True
    """DSpark's variable-length verification: each step verifies, per request, the draft
    prefix that maximises expected accepted tokens per unit of step time (from the
    confidence head and a cost model fitted online). Off, every draft is verified in full
    (fixed length)."""


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    value = env.get(name, default).strip().lower()
    if value not in choices:
        raise ConfigError(f"{name}={env[name]!r} is not valid; use one of {', '.join(choices)}")
    return value


def load(env: Mapping[str, str] | None = None) -> DeepInferSettings:
    env = os.environ if env is None else env
    return DeepInferSettings(
        model_impl=_choice(env, "DEEPINFER_MODEL_IMPL", MODEL_IMPL_CHOICES, "auto"),
        grammar_cache=_switch(env, "DEEPINFER_GRAMMAR_CACHE", "on"),
        grammar_cache_dir=_directory(env, "DEEPINFER_GRAMMAR_CACHE_DIR",
                                     DEFAULT_GRAMMAR_CACHE_DIR),
        async_scheduling=_switch(env, "DEEPINFER_ASYNC_SCHEDULING", "on"),
        yoco_prefill_keep_tokens=_keep_tokens(env, "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"),
        enable_mtp_varlen=_switch(env, "DEEPINFER_ENABLE_MTP_VARLEN", "on"),
    )


def _keep_tokens(env: Mapping[str, str], name: str) -> int:
    """A token count (checked against the model's window when the model is built), or
    `0`/`off` for exact mode."""
    value = env.get(name, str(DEFAULT_KEEP_TOKENS)).strip().lower()
    if value == "off":
        return EXACT_MODE
    if not value.isdigit():
        raise ConfigError(f"{name}={env[name]!r} is not valid; give a number of tokens at "
                          f"least the model's sliding window (default {DEFAULT_KEEP_TOKENS}), "
                          "or 0/off for exact mode")
    return int(value)


def _switch(env: Mapping[str, str], name: str, default: str) -> bool:
    """`on`/`1` or `off`/`0`."""
    return SWITCH_VALUES[_choice(env, name, tuple(SWITCH_VALUES), default)]


def _directory(env: Mapping[str, str], name: str, default: str) -> str:
    value = env.get(name, default)
    if not value.strip():
        raise ConfigError(f"{name} is empty; give a directory or leave it unset")
    if os.path.exists(value) and not os.path.isdir(value):
        raise ConfigError(f"{name}={value!r} is not a directory")
    return value


@contextlib.contextmanager
def overridden(**variables: str) -> Iterator[None]:
    """Environment variables set while engines are built inside (their processes read
    DEEPINFER_* settings when they start), then put back."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
