"""The batched step's parts against the per-request and per-expert forms they replace:
the padded request groups, the grouped experts, the batched indexer scores and the tiled
attention. (The
whole paged model against the dense reference is tests/model/test_fidelity.py.)"""

import pytest
import torch
import torch.nn.functional as F

from helpers import dense_experts
from vllm_deepinfer.kv_cache.paged import PagedStepMetadata
from vllm_deepinfer.model.deepseek_v41.attention import sink_attention, tiled_sink_attention
from vllm_deepinfer.model.deepseek_v41.indexer import _index_scores, index_scores, topk_groups
from vllm_deepinfer.model.deepseek_v41.moe import clamped_swiglu, grouped_experts
from vllm_deepinfer.model.deepseek_v41.step import StepBatch

pytestmark = pytest.mark.unit


def step_metadata(query_lens: list[int], seq_lens: list[int]) -> PagedStepMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return PagedStepMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        block_table=torch.zeros(len(query_lens), 4, dtype=torch.int64),
        block_size=16,
        tokens_per_state=1,
        seq_lens=seq_lens,
        query_start_loc=starts,
        num_reqs=len(query_lens),
        num_actual_tokens=starts[-1],
        replay_start=torch.zeros(len(query_lens), dtype=torch.int64),
        kept_from=torch.zeros(len(query_lens), dtype=torch.int64),
    )


def test_requests_become_decode_and_chunk_groups():
    """Decodes in one group of width 1, chunks padded to the longest; every token appears
    exactly once, at its request; a request with no tokens this step is in no group."""
    step = StepBatch.from_metadata(
        step_metadata([1, 5, 0, 1, 3], [9, 5, 4, 30, 12]), torch.device("cpu")
    )
    assert step.request_of_token.tolist() == [0, 1, 1, 1, 1, 1, 3, 4, 4, 4]
    decodes, chunks = step.groups
    assert decodes.requests.tolist() == [0, 3] and decodes.tokens.tolist() == [[0], [6]]
    assert decodes.seq_lens.tolist() == [9, 30]
    assert chunks.requests.tolist() == [1, 4]
    assert chunks.tokens.tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, -1, -1]]
    present = torch.cat([g.tokens[g.present] for g in step.groups]).sort().values
    assert present.tolist() == list(range(10))


def test_a_step_of_decodes_only_has_one_group():
    """Built by from_metadata's decode shortcut: the layout from_layout gives."""
    md = step_metadata([1, 1, 1], [3, 8, 2])
    step = StepBatch.from_metadata(md, torch.device("cpu"))
    assert len(step.groups) == 1 and step.groups[0].tokens.shape == (3, 1)
    general = StepBatch.from_layout(
        torch.ones(3, dtype=torch.int64),
        torch.tensor([3, 8, 2]),
        md.replay_start,
        md.kept_from,
        torch.device("cpu"),
    )
    assert step.num_tokens == general.num_tokens == 3
    for name in ("request_of_token", "seq_lens", "replay_start", "kept_from"):
        assert torch.equal(getattr(step, name), getattr(general, name)), name
    for name in ("requests", "tokens", "seq_lens"):
        assert torch.equal(getattr(step.groups[0], name), getattr(general.groups[0], name)), name


def test_decoder_replay_keeps_each_chunks_rows_from_kept_from():
    """The kept rows of a chunk are a suffix of it; the subset lays them out from column 0
    with the requests' indices, context lengths and replay starts unchanged."""
    md = step_metadata([1, 5, 3], [9, 5, 12])
    md.kept_from = torch.tensor([0, 3, 11])
    step = StepBatch.from_metadata(md, torch.device("cpu"))
    positions = torch.tensor([8, 0, 1, 2, 3, 4, 9, 10, 11])
    kept = step.kept(positions)
    assert kept.tolist() == [0, 4, 5, 8]
    subset = step.subset(kept)
    assert subset.num_tokens == 4 and subset.request_of_token.tolist() == [0, 1, 1, 2]
    singles, chunks = subset.groups
    assert singles.requests.tolist() == [0, 2] and singles.tokens.tolist() == [[0], [3]]
    assert singles.seq_lens.tolist() == [9, 12]
    assert chunks.requests.tolist() == [1] and chunks.tokens.tolist() == [[1, 2]]
    assert subset.kept_from.tolist() == [0, 3, 11]
    md.kept_from = torch.zeros(3, dtype=torch.int64)
    assert StepBatch.from_metadata(md, torch.device("cpu")).kept(positions) is None


def _experts_one_by_one(x, weights, chosen, w13, w2, limit):
    """The loop the grouped computation replaces: each used expert on its own tokens."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for e in chosen.unique().tolist():
        tokens, slot = (chosen == e).nonzero(as_tuple=True)
        gate_up = x[tokens] @ w13[e].T
        act = clamped_swiglu(gate_up[:, :inter], gate_up[:, inter:], limit)
        out.index_add_(0, tokens, (act @ w2[e].T) * weights[tokens, slot, None])
    return out


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (7, 8, 2), (40, 16, 4), (3, 64, 6)])
def test_grouped_experts_match_the_per_expert_loop(tokens, experts, top_k):
    """Some experts unused, some busy (skewed routing), a single token: the experts taken
    one at a time on their sorted rows give the loop's result."""
    g = torch.Generator().manual_seed(tokens * experts)
    hidden, inter = 32, 24
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64)
    logits[:, 0] += 3  # expert 0 is everyone's favourite
    chosen = logits.topk(top_k, dim=-1).indices
    weights = F.softmax(torch.randn(tokens, top_k, generator=g, dtype=torch.float64), -1)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g, dtype=torch.float64)
    w2 = torch.randn(experts, hidden, inter, generator=g, dtype=torch.float64)
    got = grouped_experts(x, weights, chosen, dense_experts(w13, w2), limit=7.0)
    torch.testing.assert_close(got, _experts_one_by_one(x, weights, chosen, w13, w2, 7.0))


def test_batched_index_scores_match_each_request_alone(monkeypatch):
    """Padded groups scored at once (in query tiles too) equal each request scored on its
    own keys."""
    g = torch.Generator().manual_seed(0)
    r, q, heads, d, groups = 3, 5, 4, 16, 11
    q_idx = torch.randn(r, q, heads, d, generator=g)
    weights = torch.randn(r, q, heads, generator=g)
    keys = torch.randn(r, groups, d, generator=g)
    expected = torch.stack([index_scores(q_idx[i], weights[i], keys[i]) for i in range(r)])
    torch.testing.assert_close(_index_scores(q_idx, weights, keys), expected)
    monkeypatch.setattr(
        "vllm_deepinfer.model.deepseek_v41.indexer.SCORE_BUDGET", 2 * r * heads * groups
    )
    torch.testing.assert_close(_index_scores(q_idx, weights, keys), expected)


def test_topk_groups_marks_what_is_not_allowed():
    """Fewer allowed positions than k: the rest of the k slots are invalid, the allowed
    ones come first by score, ties to the lower index."""
    scores = torch.tensor([[0.0, 2.0, 2.0, 5.0, 1.0]])
    allowed = torch.tensor([[True, True, True, False, False]])
    chosen, valid = topk_groups(scores, allowed, 4)
    assert chosen[0, :3].tolist() == [1, 2, 0]
    assert valid.tolist() == [[True, True, True, False]]


@pytest.mark.parametrize("with_own_keys", [True, False])
def test_tiled_attention_matches_each_query_on_its_own_keys(with_own_keys):
    """A tile's shared window span and per-query top-k keys, one softmax with the sink,
    equal each query attending to exactly its own keys (its window, then its top-k)."""
    g = torch.Generator().manual_seed(1)
    r, s, heads, d, window, k = 2, 5, 3, 8, 4, 3
    q = torch.randn(r, s, heads, d, generator=g)
    span_keys = torch.randn(r, s + window - 1, d, generator=g)
    own_keys = torch.randn(r, s, k, d, generator=g)
    own_mask = torch.rand(r, s, k, generator=g) > 0.3
    sink = torch.randn(heads, generator=g)
    # query j sees span keys j .. j + window - 1; row 1's first two window keys are unwritten
    delta = torch.arange(s)[:, None] + window - 1 - torch.arange(s + window - 1)[None, :]
    span_mask = ((delta >= 0) & (delta < window)).expand(r, -1, -1).clone()
    span_mask[1, :, :2] = False
    out = tiled_sink_attention(
        q,
        span_keys,
        span_mask,
        own_keys if with_own_keys else None,
        own_mask if with_own_keys else None,
        sink,
        0.5,
    )
    for i in range(r):
        for j in range(s):
            keys, mask = span_keys[i], span_mask[i, j]
            if with_own_keys:
                keys, mask = torch.cat([own_keys[i, j], keys]), torch.cat([own_mask[i, j], mask])
            expected = sink_attention(q[i, j][None], keys, mask[None], sink, 0.5)[0]
            torch.testing.assert_close(out[i, j], expected)


def test_stable_topk_is_a_stable_descending_sorts_first_k():
    """Ties (ReLU zeros, equal scores) go to the lower index and -inf rows still give k
    indices, as the full sort it replaces did."""
    from vllm_deepinfer.model.deepseek_v41.ops import stable_topk

    g = torch.Generator().manual_seed(0)
    rows = [
        torch.randn(6, 300, generator=g).relu(),
        torch.randint(0, 3, (6, 40), generator=g).float(),
        torch.full((2, 20), float("-inf")),
        torch.zeros(3, 16),
        # wider than SORTED_TOPK_WIDTH: found without sorting every score
        torch.randn(3, 3000, generator=g).relu(),
        torch.full((2, 2000), float("-inf")),
    ]
    rows[2][0, 7] = rows[5][0, 1500] = 1.0
    for scores in rows:
        for k in (1, 5, 16):
            expected = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
            assert torch.equal(stable_topk(scores, k), expected)
