"""The compiled hyper-connection mixes against their eager torch form, and the fallback
to eager when torch.compile cannot compile."""
import logging

import pytest
import torch

from vllm_deepinfer.model.deepseek_v41 import ops
from vllm_deepinfer.model.deepseek_v41.hyper_connections import hc_mixes, hc_mixes_compiled

pytestmark = pytest.mark.unit


def mixes_inputs(tokens: int, hc: int = 4, hidden: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hc, hidden, generator=g),
            torch.randn((2 + hc) * hc, hc * hidden, generator=g) * 0.1,
            torch.randn((2 + hc) * hc, generator=g), torch.rand(3, generator=g),
            1e-6, 1e-6, 20)


def test_compiled_hc_mixes_match_eager_for_any_token_count():
    for tokens in (1, 8, 33):
        for got, expected in zip(hc_mixes_compiled(*mixes_inputs(tokens)),
                                 hc_mixes(*mixes_inputs(tokens))):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_failed_compile_falls_back_to_eager_once(monkeypatch, caplog):
    calls = []

    def cannot_compile(fn, **kwargs):
        def run(*args):
            calls.append("compiled")
            raise RuntimeError("no C++ compiler")
        return run

    def twice(x):
        calls.append("eager")
        return 2 * x

    monkeypatch.setattr(torch, "compile", cannot_compile)
    doubled = ops.compiled(twice)
    caplog.set_level(logging.WARNING, logger="vllm.deepinfer")
    with caplog.at_level(logging.WARNING):
        assert doubled(torch.ones(1)).item() == 2
        assert doubled(torch.ones(1)).item() == 2
    assert calls == ["compiled", "eager", "eager"]
    warnings = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(warnings) == 1 and "RuntimeError: no C++ compiler" in warnings[0]
