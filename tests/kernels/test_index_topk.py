"""The indexer's selection kernel (kernels/index_topk.py) against its torch twins, the
indexer's `topk_groups` + scatter and `candidate_blocks`: the same indices in the same
order, ties, NaN, infinities, empty rows and wide rows included."""

import pytest
import torch

from vllm_deepinfer.kernels import index_topk as kernel
from vllm_deepinfer.model.deepseek_v41.indexer import candidate_blocks, topk_groups

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def built():
    if kernel.library() is None:
        pytest.skip("no C compiler on this machine: the kernel is not built")


def scores_with_ties(rows: int, groups: int, seed: int, specials: bool) -> torch.Tensor:
    """Scores on a coarse grid (many exact ties, as ReLU scores tie at 0), with NaN and
    infinities sprinkled in when `specials`."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (rows, groups), generator=g).float().clamp_min(0) / 2
    if specials:
        pick = torch.rand(rows, groups, generator=g)
        scores[pick < 0.05] = float("nan")
        scores[(pick >= 0.05) & (pick < 0.08)] = float("inf")
        scores[(pick >= 0.08) & (pick < 0.11)] = float("-inf")
    return scores


def twin_select(scores, visible, candidates, k, tokens, n_tokens):
    allowed = torch.arange(scores.shape[1])[None, :] < visible[:, None]
    if candidates is not None:
        allowed &= candidates
    top, ok = topk_groups(scores, allowed, k)
    chosen = torch.zeros(n_tokens, k, dtype=torch.int64)
    valid = torch.zeros(n_tokens, k, dtype=torch.bool)
    present = tokens >= 0
    chosen[tokens[present], : top.shape[1]] = top[present]
    valid[tokens[present], : top.shape[1]] = ok[present]
    return chosen, valid


@pytest.mark.parametrize("specials", [False, True])
@pytest.mark.parametrize(
    ("rows", "groups", "k"),
    [(1, 5, 16), (7, 40, 16), (33, 300, 8), (4, 1500, 64), (64, 9, 3)],  # 1500: the wide twin
)
def test_selection_equals_the_twin(rows, groups, k, specials):
    g = torch.Generator().manual_seed(rows * groups)
    scores = scores_with_ties(rows, groups, seed=groups, specials=specials)
    visible = torch.randint(0, groups + 1, (rows,), generator=g)
    visible[0] = 0  # a row that sees nothing: every choice invalid
    candidates = torch.rand(rows, groups, generator=g) < 0.5
    tokens = torch.randperm(rows + 3, generator=g)[:rows]
    tokens[-1] = -1  # a padding row: written nowhere
    for blocks in (None, candidates):
        expected = twin_select(scores, visible, blocks, k, tokens, rows + 3)
        chosen = torch.zeros(rows + 3, k, dtype=torch.int64)
        valid = torch.zeros(rows + 3, k, dtype=torch.bool)
        kernel.select_into(scores, visible, blocks, k, tokens, chosen, valid)
        assert torch.equal(chosen, expected[0])
        assert torch.equal(valid, expected[1])


@pytest.mark.parametrize("specials", [False, True])
@pytest.mark.parametrize(("rows", "groups"), [(1, 3), (9, 64), (20, 250), (3, 2000)])
@pytest.mark.parametrize(("block_size", "top_blocks"), [(8, 4), (5, 2), (64, 40)])
def test_candidate_blocks_equal_the_twin(rows, groups, block_size, top_blocks, specials):
    g = torch.Generator().manual_seed(groups + block_size)
    scores = scores_with_ties(rows, groups, seed=rows, specials=specials)
    visible = torch.randint(0, groups + 1, (rows,), generator=g)
    visible[0] = 0
    expected = candidate_blocks(scores, visible, block_size, top_blocks)
    assert torch.equal(kernel.candidate_blocks(scores, visible, block_size, top_blocks), expected)


def test_a_token_outside_the_rows_is_refused():
    scores = torch.zeros(2, 4)
    chosen = torch.zeros(2, 2, dtype=torch.int64)
    valid = torch.zeros(2, 2, dtype=torch.bool)
    with pytest.raises(IndexError, match="outside the 2 rows"):
        kernel.select_into(
            scores, torch.tensor([4, 4]), None, 2, torch.tensor([0, 2]), chosen, valid
        )
    with pytest.raises(ValueError, match="2 columns for the top 3"):
        kernel.select_into(
            scores, torch.tensor([4, 4]), None, 3, torch.tensor([0, 1]), chosen, valid
        )
