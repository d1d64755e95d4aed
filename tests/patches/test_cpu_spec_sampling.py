"""Patch cpu_spec_sampling: verification's per-position temperature, top-k and top-p are
each request's own on the CPU (vLLM's CPU expand kernel wrote them into a discarded int64
copy), and a step with no verified positions passes through top-k instead of killing the
engine core. The engine-level matrix is tests/spec_decode/test_sampling_parameters.py."""

import pytest
import torch

from vllm_deepinfer.patches import cpu_spec_sampling

pytestmark = pytest.mark.unit


@pytest.fixture
def rejection_sampler(monkeypatch):
    """vLLM's rejection-sampler module with the patch applied for this test only."""
    from vllm.v1.sample import rejection_sampler as module

    for name in ("expand_batch_to_tokens", "apply_sampling_constraints"):
        monkeypatch.setattr(module, name, getattr(module, name))
    assert cpu_spec_sampling.apply(on_cpu=True) is True
    return module


@pytest.mark.parametrize(
    "values",
    [
        torch.tensor([0.5, 0.0, 1.5]),
        torch.tensor([5, 0, 7], dtype=torch.int32),
        torch.tensor([5, 0, 7], dtype=torch.int64),
    ],
    ids=["float32", "int32", "int64"],
)
def test_each_request_value_fills_its_positions(values):
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # 2 drafts, none, 3
    expanded = cpu_spec_sampling.expand_batch_to_tokens(values, cu, 5, replace_from=0, replace_to=1)
    assert expanded.dtype == values.dtype
    assert expanded.tolist() == [values[0].item()] * 2 + [values[2].item()] * 3
    zero = cpu_spec_sampling.expand_batch_to_tokens(values[1:2], cu[:1] * 0, 0)
    assert zero.shape == (0,)


def test_replaced_values_are_replaced():
    cu = torch.tensor([1, 3], dtype=torch.int64)
    expanded = cpu_spec_sampling.expand_batch_to_tokens(
        torch.tensor([0.0, 0.7]), cu, 3, replace_from=0, replace_to=1
    )
    assert expanded.tolist() == pytest.approx([1.0, 0.7, 0.7])


@pytest.mark.model_runner_v1
def test_the_cpu_expand_kernel_is_the_one_that_drops_outputs():
    """What the CPU half is applied for, read from vLLM as installed."""
    assert cpu_spec_sampling._cpu_expand_drops_outputs()


def _metadata(temperature, top_k, top_p):
    from vllm.v1.sample.metadata import SamplingMetadata

    batch = temperature.shape[0]
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=False,
        all_random=True,
        top_p=top_p,
        top_k=top_k,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=None,
    )


@pytest.mark.model_runner_v1
def test_no_verified_positions_pass_through_top_k(rejection_sampler):
    metadata = _metadata(torch.tensor([0.8]), torch.tensor([5], dtype=torch.int32), None)
    logits = torch.empty(0, 32)
    out = rejection_sampler.apply_sampling_constraints(
        logits, torch.tensor([0], dtype=torch.int32), metadata
    )
    assert out.shape == (0, 32)


@pytest.mark.model_runner_v1
def test_verified_positions_get_their_requests_limits(rejection_sampler):
    torch.manual_seed(0)
    logits = torch.randn(5, 64)
    temperature = torch.tensor([0.5, 2.0])
    top_k = torch.tensor([3, 10], dtype=torch.int32)
    cu = torch.tensor([2, 5], dtype=torch.int32)
    out = rejection_sampler.apply_sampling_constraints(
        logits.clone(), cu, _metadata(temperature, top_k, None)
    )
    per_row_temperature = torch.tensor([0.5, 0.5, 2.0, 2.0, 2.0])
    per_row_k = [3, 3, 10, 10, 10]
    for row in range(5):
        kept = torch.isfinite(out[row])
        assert int(kept.sum()) == per_row_k[row]
        want = (logits[row] / per_row_temperature[row]).topk(per_row_k[row])
        assert set(want.indices.tolist()) == set(kept.nonzero().flatten().tolist())
        torch.testing.assert_close(out[row][want.indices], want.values)
