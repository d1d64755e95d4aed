"""Loggers under vLLM's `vllm` tree, so the plugin's lines appear in `vllm serve` output
with vLLM's format, level and stream (vLLM configures that tree only; a logger outside
it prints nothing there)."""

from __future__ import annotations

import logging

from vllm.logger import init_logger as _vllm_init_logger

_PACKAGE = "vllm_deepinfer"


def init_logger(module_name: str) -> logging.Logger:
    """`init_logger(__name__)`: vllm_deepinfer.x.y logs as vllm.deepinfer.x.y."""
    suffix = module_name[len(_PACKAGE) :] if module_name.startswith(_PACKAGE) else f".{module_name}"
    return _vllm_init_logger(f"vllm.deepinfer{suffix}")
