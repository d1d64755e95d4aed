"""The parts of batch invariance and deterministic sampling, in-process: the fixed-tile
products, the model's fixed-order reductions against their normal forms, vLLM's CPU
kernels (in a subprocess: they replace aten ops process-wide), the settings' checks and
the keyed verification."""

import pytest
import torch

from helpers import dense_experts, run_python
from vllm_deepinfer import envs
from vllm_deepinfer.determinism import batch_invariant


@pytest.fixture
def invariant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert batch_invariant.enabled()


def rows_alone_and_batched(fn, row: torch.Tensor, sizes=(1, 3, 16, 17, 40)) -> None:
    """fn(rows)[i] for `row` placed at several positions of random batches equals
    fn(row alone), bit for bit."""
    gen = torch.Generator().manual_seed(0)
    alone = fn(row[None])[0]
    for size in sizes:
        for position in {0, size // 2, size - 1}:
            batch = torch.randn(size, *row.shape, generator=gen)
            batch[position] = row
            assert torch.equal(fn(batch)[position], alone), (size, position)


@pytest.mark.unit
def test_fixed_tile_products_are_the_products_and_do_not_follow_the_batch():
    gen = torch.Generator().manual_seed(1)
    weight, row = torch.randn(24, 1024, generator=gen), torch.randn(1024, generator=gen)
    rows = torch.randn(37, 1024, generator=gen)
    torch.testing.assert_close(batch_invariant.linear(rows, weight), rows @ weight.T)
    rows_alone_and_batched(lambda x: batch_invariant.linear(x, weight), row)
    keys = torch.randn(512, 48, generator=gen)
    entry = torch.randn(4, 512, generator=gen)
    torch.testing.assert_close(
        batch_invariant.bmm(entry.expand(3, -1, -1), keys.expand(3, -1, -1)),
        (entry @ keys).expand(3, -1, -1),
    )
    rows_alone_and_batched(lambda x: batch_invariant.bmm(x, keys.expand(x.shape[0], -1, -1)), entry)
    values = torch.randn(3, 5, 7, generator=gen)
    weights = torch.rand(3, 5, generator=gen)
    torch.testing.assert_close(
        batch_invariant.weighted_sum(weights, values), torch.einsum("tj,tjd->td", weights, values)
    )


def mismatches(fn, width: int, sizes=(3, 7, 16, 33, 1000), seeds=range(12)) -> int:
    """How many (row, batch size, position) cases give a row other values than alone."""
    count = 0
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        row = torch.randn(width, generator=gen) * 4
        alone = fn(row[None])[0]
        for size in sizes:
            for position in {0, size // 2, size - 1}:
                batch = torch.randn(size, width, generator=gen)
                batch[position] = row
                count += not torch.equal(fn(batch)[position], alone)
    return count


@pytest.mark.unit
@pytest.mark.parametrize(
    "fn",
    [torch.sigmoid, torch.nn.functional.silu, torch.nn.functional.softplus],
    ids=["sigmoid", "silu", "softplus"],
)
def test_pointwise_functions_take_one_path_per_element(invariant, fn):
    """torch's SIMD kernels compute a call's leftover elements with scalar code whose last
    bit differs (the plain function shows it here); in batch-invariant mode a row's values
    are the same alone and anywhere in a batch of any size, below and above torch's
    parallel grain, for widths that are and are not multiples of the SIMD width."""
    assert mismatches(fn, 4) > 0
    for width in (4, 24, 64, 129):
        assert (
            mismatches(
                lambda x: batch_invariant.pointwise(fn, x),
                width,
                sizes=(3, 7, 16, 33, 1000, 40000 // width),
            )
            == 0
        )
    row = torch.randn(24)
    torch.testing.assert_close(batch_invariant.pointwise(fn, row[None])[0], fn(row))


@pytest.mark.unit
def test_fixed_order_model_parts_match_their_normal_forms(invariant, monkeypatch):
    """In batch-invariant mode each reduction of the model gives what the normal mode gives
    (to rounding), and a token's result does not depend on the others."""
    from vllm_deepinfer.model.deepseek_v41.attention import per_query_sink_attention, sink_attention
    from vllm_deepinfer.model.deepseek_v41.hyper_connections import hc_mixes, hc_update
    from vllm_deepinfer.model.deepseek_v41.indexer import fixed_order_index_scores, index_scores
    from vllm_deepinfer.model.deepseek_v41.moe import fixed_order_experts, grouped_experts

    gen = torch.Generator().manual_seed(2)
    q, w, keys = (
        torch.randn(2, 5, 4, 64, generator=gen),
        torch.randn(2, 5, 4, generator=gen),
        torch.randn(2, 70, 64, generator=gen),
    )
    torch.testing.assert_close(fixed_order_index_scores(q, w, keys), index_scores(q, w, keys))

    x, w13, w2 = (
        torch.randn(23, 32, generator=gen),
        torch.randn(8, 32, 32, generator=gen),
        torch.randn(8, 32, 16, generator=gen),
    )
    chosen = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(23)])
    weights = torch.rand(23, 2, generator=gen)
    torch.testing.assert_close(
        fixed_order_experts(x, weights, chosen, dense_experts(w13, w2), 10.0),
        grouped_experts(x, weights, chosen, dense_experts(w13, w2), 10.0),
    )
    rows_alone_and_batched(
        lambda rows: fixed_order_experts(
            rows,
            weights[:1].expand(rows.shape[0], -1),
            chosen[:1].expand(rows.shape[0], -1),
            dense_experts(w13, w2),
            10.0,
        ),
        x[0],
    )

    qa, ka = torch.randn(6, 4, 64, generator=gen), torch.randn(48, 64, generator=gen)
    mask, sink = torch.rand(6, 48, generator=gen) > 0.3, torch.randn(4, generator=gen)
    torch.testing.assert_close(
        per_query_sink_attention(qa, ka.expand(6, -1, -1), mask, sink, 0.1),
        sink_attention(qa, ka, mask, sink, 0.1),
    )

    copies = torch.randn(9, 4, 32, generator=gen)
    fn, base, scale = (
        torch.randn(24, 128, generator=gen) * 0.1,
        torch.randn(24, generator=gen),
        torch.rand(3, generator=gen),
    )
    invariant_mixes = hc_mixes(copies, fn, base, scale, 1e-6, 1e-6, 20)
    out = torch.randn(9, 32, generator=gen)
    invariant_update = hc_update(copies, invariant_mixes[2], invariant_mixes[1], out)
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "0")
    for got, expected in zip(invariant_mixes, hc_mixes(copies, fn, base, scale, 1e-6, 1e-6, 20)):
        torch.testing.assert_close(got, expected)
    torch.testing.assert_close(
        invariant_update, hc_update(copies, invariant_mixes[2], invariant_mixes[1], out)
    )


@pytest.mark.engine  # a fresh process importing vLLM (~10 s): kept out of the unit run
def test_cpu_kernels_for_vllms_switch_are_invariant_and_right():
    """Registered for the CPU (in a subprocess: they replace aten ops process-wide), mm,
    addmm, bmm and mean give torch's values and rows that do not follow the batch; so does
    the model's per-query attention, its keys a strided view as the engine gathers them."""
    run_python("""
import torch
from vllm_deepinfer.determinism import cpu_ops
gen = torch.Generator().manual_seed(3)
a, b, bias = torch.randn(37, 96, generator=gen), torch.randn(96, 40, generator=gen), torch.randn(40, generator=gen)
x3, y3 = torch.randn(3, 21, 96, generator=gen), torch.randn(3, 96, 8, generator=gen)
reference = (a @ b, torch.addmm(bias, a, b, beta=0.5, alpha=2.0), torch.bmm(x3, y3),
             a.mean(-1), a.mean(), x3.mean(1, keepdim=True))
cpu_ops.register()
got = (a @ b, torch.addmm(bias, a, b, beta=0.5, alpha=2.0), torch.bmm(x3, y3),
       a.mean(-1), a.mean(), x3.mean(1, keepdim=True))
for g, r in zip(got, reference):
    torch.testing.assert_close(g, r)
torch.set_num_threads(2)
row = a[5]
alone = torch.nn.functional.linear(row[None], b.T.contiguous())[0]
for size in (2, 16, 33):
    batch = torch.randn(size, 96, generator=gen)
    batch[size - 1] = row
    assert torch.equal(torch.nn.functional.linear(batch, b.T.contiguous())[size - 1], alone)
big = torch.randn(1, 40000, generator=gen)
assert torch.equal(big.mean(-1), torch.cat([big, torch.randn(3, 40000)]).mean(-1)[:1])

# The model's per-query attention, with the kernels the engine's processes run.
import os
os.environ["DEEPINFER_BATCH_INVARIANT"] = "1"
from vllm_deepinfer.model.deepseek_v41.attention import per_query_sink_attention
q0, k0, m0, sink = torch.randn(4, 64), torch.randn(48, 64), torch.rand(48) > 0.3, torch.randn(4)
def attend(count, at):
    q, k, m = torch.randn(count, 4, 64), torch.randn(count, 48, 64), torch.rand(count, 48) > 0.3
    q[at], k[at], m[at] = q0, k0, m0
    return per_query_sink_attention(q, k.transpose(1, 2).contiguous().transpose(1, 2), m, sink, 0.1)[at]
alone = attend(1, 0)
for count, at in ((16, 0), (16, 15), (17, 16), (40, 20)):
    assert torch.equal(attend(count, at), alone), (count, at)
""")


@pytest.mark.unit
@pytest.mark.parametrize(
    "variables,named",
    [
        (
            {"DEEPINFER_DETERMINISTIC_SAMPLING": "1", "DEEPINFER_ENABLE_MTP_VARLEN": "0"},
            "DEEPINFER_BATCH_INVARIANT=1",
        ),
        (
            {"DEEPINFER_DETERMINISTIC_SAMPLING": "1", "DEEPINFER_BATCH_INVARIANT": "1"},
            "DEEPINFER_ENABLE_MTP_VARLEN=0",
        ),
        ({"VLLM_BATCH_INVARIANT": "yes"}, "VLLM_BATCH_INVARIANT"),
    ],
)
def test_settings_refuse_what_deterministic_sampling_cannot_keep(variables, named):
    with pytest.raises(envs.ConfigError, match=named):
        envs.load(variables)


@pytest.mark.unit
def test_settings_that_work_together():
    for variables in (
        {
            "DEEPINFER_DETERMINISTIC_SAMPLING": "1",
            "DEEPINFER_BATCH_INVARIANT": "1",
            "DEEPINFER_ENABLE_MTP_VARLEN": "0",
        },
        {
            "DEEPINFER_DETERMINISTIC_SAMPLING": "1",
            "VLLM_BATCH_INVARIANT": "1",
            "DEEPINFER_ENABLE_MTP_VARLEN": "0",
        },
    ):
        assert envs.load(variables).deterministic_sampling
    assert not envs.load({}).batch_invariant


@pytest.mark.engine
def test_an_engine_asked_for_deterministic_sampling_alone_stops_naming_the_setting(tiny_checkpoint):
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from vllm import LLM; "
            f"LLM(model={tiny_checkpoint!r}, dtype='float32', max_model_len=256)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "DEEPINFER_DETERMINISTIC_SAMPLING": "1"},
    )
    assert result.returncode != 0
    assert "DEEPINFER_BATCH_INVARIANT=1" in result.stderr


@pytest.mark.unit
@pytest.mark.model_runner_v1  # determinism.sampling extends V1's rejection sampler
def test_position_seeds_are_fixed_and_distinct():
    from vllm_deepinfer.determinism.sampling import position_seed

    seeds = {position_seed(seed, position) for seed in (0, 1, -5, 2**62) for position in range(50)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 for s in seeds)
    assert position_seed(7, 3) == position_seed(7, 3)


@pytest.mark.unit
@pytest.mark.model_runner_v1
def test_drafts_are_accepted_while_they_equal_the_samples():
    from types import SimpleNamespace

    from vllm_deepinfer.determinism.sampling import PositionKeyedRejectionSampler

    metadata = SimpleNamespace(
        draft_token_ids=torch.tensor([5, 6, 7, 1, 2]),
        num_draft_tokens=[3, 2],
        cu_num_draft_tokens=torch.tensor([3, 5]),
    )
    output = torch.full((2, 4), -7, dtype=torch.int32)
    bonus = torch.tensor([[40], [41]])
    samples = torch.tensor([5, 9, 7, 1, 2])  # request 0 differs at 1; request 1 all equal
    PositionKeyedRejectionSampler._accept_equal(
        output, metadata, bonus, samples, [0, 3, 5], {0: (1, 10), 1: (2, 20)}
    )
    assert output.tolist() == [[5, 9, -1, -1], [1, 2, 41, -1]]
