"""Which kernel each part of V4.1 takes on this machine (kernels/paths.py): every part named,
vLLM's kernels detected per op in the `_C` library vLLM loaded, and a reason for each
part the plugin computes."""

import pytest
import torch

from vllm_deepinfer.kernels import paths

pytestmark = pytest.mark.unit

REAL = paths.Model(torch.bfloat16, 384, 6)
"""V4.1-Flash served in bf16: the shape vLLM's router kernel takes."""
TINY_FP32 = paths.Model(torch.float32, 8, 2)
"""The tiny model in fp32: no vLLM kernel takes it."""


@pytest.fixture(autouse=True)
def fresh_choice():
    paths.selected.cache_clear()
    yield
    paths.selected.cache_clear()


@pytest.mark.parametrize("model", [REAL, TINY_FP32])
def test_every_part_has_a_path_and_a_reason(model):
    chosen = paths.selected(model)
    assert list(chosen) == [part.name for part in paths.PARTS]
    for name, (path, why) in chosen.items():
        assert path in (paths.VLLM, paths.PLUGIN)
        assert why, name
    assert paths.summary(model) == {name: path for name, (path, _) in chosen.items()}


def test_vllms_kernel_is_chosen_where_it_is_loaded_and_fits():
    real, tiny = paths.summary(REAL), paths.summary(TINY_FP32)
    for part, op in (
        ("hyper_connection_post", "hc_post_fused_cpu"),
        ("router_topk", "biased_topk_cpu"),
    ):
        assert real[part] == (paths.VLLM if paths.vllm_has(op) else paths.PLUGIN)
        assert tiny[part] == paths.PLUGIN


def test_the_ops_are_detected_in_the_library_vllm_loaded():
    """Where this CPU's `_C` lacks an op (AVX2 machines load _C_AVX2), the reason says so;
    where it has it, the reason names what keeps the plugin's path."""
    chosen = paths.selected(TINY_FP32)
    for part in paths.PARTS:
        if part.vllm_op is None:
            continue
        why = chosen[part.name][1]
        assert part.vllm_op in why
        if paths.vllm_has(part.vllm_op):
            assert "not in the _C library" not in why
        else:
            assert "not in the _C library" in why


def test_the_quantized_product_names_its_kernel(monkeypatch):
    from vllm_deepinfer.kernels import weight_gemv

    why = paths.selected(REAL)["quantized_matmul"][1]
    if weight_gemv.library() is not None:
        assert "C kernel" in why
    monkeypatch.setenv("DEEPINFER_MX_KERNEL", "tiled")
    paths.selected.cache_clear()
    weight_gemv.enabled.cache_clear()
    try:
        assert "DEEPINFER_MX_KERNEL=tiled" in paths.selected(REAL)["quantized_matmul"][1]
    finally:
        weight_gemv.enabled.cache_clear()


def test_the_sparse_attention_names_its_kernel(monkeypatch):
    from vllm_deepinfer.kernels import sparse_attention

    parts = ("sparse_attention_decode", "indexer_scores", "kv_insert")
    if sparse_attention.library() is not None:
        assert all("C kernel" in paths.selected(REAL)[part][1] for part in parts)
    monkeypatch.setenv("DEEPINFER_ATTENTION_KERNEL", "torch")
    paths.selected.cache_clear()
    sparse_attention.enabled.cache_clear()
    try:
        for part in parts:
            assert "DEEPINFER_ATTENTION_KERNEL=torch" in paths.selected(REAL)[part][1]
    finally:
        sparse_attention.enabled.cache_clear()


def test_the_log_names_the_cpu_and_every_part(caplog):
    paths.log_once.cache_clear()
    import logging

    with caplog.at_level(logging.INFO, logger=paths.logger.name):
        paths.log_once(REAL)
    text = caplog.text
    assert torch.backends.cpu.get_cpu_capability() in text
    for part in paths.PARTS:
        assert part.name in text
