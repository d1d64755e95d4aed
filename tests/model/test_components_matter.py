"""Every V4.1 component is live: perturbing one Engram table, one expert, one compressor
or one indexer changes the model's output (on the reference, which the vLLM model is
shown to match in test_fidelity)."""

import pytest
import torch

from fixtures.reference import ReferenceV41

pytestmark = pytest.mark.unit

PROMPT_LENGTH = 100


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return ReferenceV41(tiny_checkpoint)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(
        3, 800, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(9)
    ).tolist()


@pytest.mark.parametrize(
    "tensor",
    [
        "layers.1.engram.embed.weight",  # one Engram table
        "layers.3.ffn.experts.0.w2.weight",  # one routed expert
        "layers.4.attn.compressor.wkv.weight",  # one ratio-2 compressor
        "layers.6.attn.compressor.wkv.weight",  # the ratio-1 compressor shared by layers 6-9
        "layers.8.attn.indexer.wq_b.weight",  # an indexer that reads layer 6's candidate blocks
    ],
)
def test_perturbing_a_component_changes_the_output(reference, prompt, tensor):
    baseline = reference.logits(prompt)
    assert torch.equal(reference.logits(prompt), baseline)  # the forward is deterministic
    original = reference.w[tensor].clone()
    noise = torch.randn(
        original.shape, generator=torch.Generator().manual_seed(3), dtype=original.dtype
    )
    try:
        reference.w[tensor] = original + 0.5 * original.std() * noise
        perturbed = reference.logits(prompt)
    finally:
        reference.w[tensor] = original
    assert (perturbed - baseline).abs().max() > 1e-2


def test_indexer_perturbation_changes_the_selection(reference, prompt):
    """The indexer matters through what it selects, not only through rounding."""
    reference.logits(prompt)
    before = reference._selection[8].clone()
    name = "layers.8.attn.indexer.wq_b.weight"
    original = reference.w[name].clone()
    try:
        reference.w[name] = -original
        reference.logits(prompt)
        after = reference._selection[8].clone()
    finally:
        reference.w[name] = original
    assert before.sum(1).max() == reference.args.index_topk
    assert not torch.equal(before, after)
