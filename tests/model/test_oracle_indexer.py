"""V4.1's lightning indexer and candidate blocks against code the project did not write.

Oracles:
* transformers' DeepseekV4IndexerScorer and DeepseekV4Indexer (modeling_deepseek_v4.py,
  classes at lines 442 and 458): score = sum_h w_h ReLU(q_h . k) with w scaled by
  index_head_dim**-0.5 * index_n_heads**-0.5, queries RoPE'd at their positions, future
  groups masked, top-k. V4's indexer compresses its own keys from the hidden states over
  overlapping windows (Ca/Cb series, ratio 4); V4.1 derives its keys from the kv
  source's latent (k_norm(wk(latent)), checked in test_oracle_compressor.py). Gating the
  Ca series off (position bias -inf) at rate 2 makes V4's key pooling V4.1's pair pooling,
  so the whole query -> score -> causal top-k chain is compared there.
* upstream vLLM's torch reference of the indexer logits, `fp8_mqa_logits_torch`
  (vllm/v1/attention/ops/rocm_aiter_mla_sparse.py:825), imported.
* upstream vLLM's V4.1 candidate blocks (vllm/model_executor/kernels/attention/dsa/
  candidate_blocks.py) are Triton only (`assert logits.is_cuda`), so they are emulated
  below from their source; so is the row top-k that follows them
  (vllm/model_executor/layers/sparse_attn_indexer.py:687-720,
  `ops.top_k_per_row_prefill`, a CUDA op).
"""

import pytest
import torch

from helpers import upstream
from vllm_deepinfer.model.deepseek_v41.compressor import pool_pair
from vllm_deepinfer.model.deepseek_v41.indexer import candidate_blocks, index_scores, select_topk
from vllm_deepinfer.model.deepseek_v41.ops import rms_norm
from vllm_deepinfer.model.deepseek_v41.rope import apply_rope, rope_inv_freq

pytestmark = pytest.mark.unit

FP64_TOL = dict(atol=1e-10, rtol=0)
FP32_TOL = dict(atol=1e-5, rtol=1e-5)

HIDDEN, Q_LORA, N_HEADS, HEAD_DIM, ROPE_DIM = 32, 16, 4, 16, 8
COMPRESS_THETA, EPS = 160000.0, 1e-6


def hf_config(rate: int, index_topk: int):
    config_cls = upstream("transformers", "DeepseekV4Config")
    return config_cls(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        head_dim=32,
        partial_rotary_factor=ROPE_DIM / 32,
        q_lora_rank=Q_LORA,
        index_n_heads=N_HEADS,
        index_head_dim=HEAD_DIM,
        index_topk=index_topk,
        compress_rope_theta=COMPRESS_THETA,
        rms_norm_eps=EPS,
        compress_rates={"compressed_sparse_attention": rate, "heavily_compressed_attention": 8},
        max_position_embeddings=1024,
        layer_types=["sliding_attention"],
        mlp_layer_types=["moe"],
    )


def randomise(module: torch.nn.Module, g: torch.Generator) -> None:
    for name, p in module.named_parameters():
        if name.endswith("weight") and p.dim() == 2:
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / p.shape[1] ** 0.5)


# --- scores ----------------------------------------------------------------------------
@torch.no_grad()
def test_index_scores_match_hf_indexer_scorer():
    """Our weights carry both scales (the project multiplies weights_proj's output by
    (index_head_dim * index_n_heads)**-0.5); HF applies head_dim**-0.5 to the ReLU'd dot
    and n_heads**-0.5 to the weights. Negative weights and negative dots both occur."""
    scorer_cls = upstream(
        "transformers.models.deepseek_v4.modeling_deepseek_v4", "DeepseekV4IndexerScorer"
    )
    g = torch.Generator().manual_seed(0)
    scorer = scorer_cls(hf_config(4, 8)).double()
    randomise(scorer, g)
    t, groups = 9, 13
    q = torch.randn(1, t, N_HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    keys = torch.randn(1, groups, HEAD_DIM, generator=g, dtype=torch.float64)
    hidden = torch.randn(1, t, HIDDEN, generator=g, dtype=torch.float64)

    expected = scorer(q, keys, hidden)[0]

    weights = scorer.weights_proj(hidden[0]) * (HEAD_DIM * N_HEADS) ** -0.5
    assert (weights < 0).any() and (q[0] @ keys[0].T < 0).any()
    # HF's scorer runs its matmul in fp32 whatever the module dtype.
    torch.testing.assert_close(index_scores(q[0], weights, keys[0]), expected.double(), **FP32_TOL)


@torch.no_grad()
def test_index_scores_match_upstream_mqa_logits_reference():
    """Upstream's torch reference of the indexer logits casts q and k to bf16; integer
    entries in [-3, 3] over 16 dims make every dot product exact in bf16, so the only
    rounding left is fp32's. Per-key scales are powers of two (an fp8 cache's
    dequantisation scale, folded into our keys). Columns at or past each row's end are
    -inf upstream; those are the positions our `allowed` mask excludes."""
    logits_ref = upstream("vllm.v1.attention.ops.rocm_aiter_mla_sparse", "fp8_mqa_logits_torch")
    g = torch.Generator().manual_seed(1)
    t, groups = 11, 14
    q = torch.randint(-3, 4, (t, N_HEADS, HEAD_DIM), generator=g).float()
    k = torch.randint(-3, 4, (groups, HEAD_DIM), generator=g).float()
    k_scale = 2.0 ** torch.randint(-2, 3, (groups,), generator=g).float()
    weights = torch.randn(t, N_HEADS, generator=g)
    ends = torch.randint(0, groups + 1, (t,), generator=g).int()

    expected = logits_ref(q, (k, k_scale), weights, torch.zeros(t, dtype=torch.int32), ends)

    ours = index_scores(q, weights, k * k_scale[:, None])
    visible = torch.arange(groups)[None, :] < ends[:, None]
    assert torch.equal(torch.isfinite(expected), visible)
    torch.testing.assert_close(ours[visible], expected[visible], **FP32_TOL)


# --- the whole indexer chain vs HF's DeepseekV4Indexer ----------------------------------
@pytest.mark.parametrize("rate", [1, 2])
@torch.no_grad()
def test_indexer_topk_matches_hf_indexer(rate):
    """Keys pooled (pool_pair), normed and RoPE'd at the group start; queries RoPE'd at
    their positions; weights scaled; scores; top-k over the groups each query may see
    ((p + 1) // rate) -- the project's composition (V41Indexer.select) -- picks the same
    groups as HF's indexer, including the -1 'no group' entries of early queries."""
    indexer_cls = upstream(
        "transformers.models.deepseek_v4.modeling_deepseek_v4", "DeepseekV4Indexer"
    )
    topk, t = 5, 24
    config = hf_config(rate, topk)
    g = torch.Generator().manual_seed(2 + rate)
    indexer = indexer_cls(config).eval()
    randomise(indexer, g)
    with torch.no_grad():
        indexer.kv_norm.weight.copy_(torch.rand(HEAD_DIM, generator=g) + 0.5)
        # Ca (the previous window's series) gets weight 0; Cb is the current window.
        indexer.position_bias[:, :HEAD_DIM] = float("-inf")
        indexer.position_bias[:, HEAD_DIM:] = 0.0
    hidden = torch.randn(1, t, HIDDEN, generator=g)
    qr = torch.randn(1, t, Q_LORA, generator=g)
    positions = torch.arange(t)

    hf_top = indexer(hidden, qr, positions[None], None, 0)[0]

    # Ours (fp32 like HF's scorer, which runs in fp32 whatever the dtype).
    x = hidden[0]
    kv = (x @ indexer.kv_proj.weight.T)[:, HEAD_DIM:]
    gate = (x @ indexer.gate_proj.weight.T)[:, HEAD_DIM:]
    groups = t // rate
    pooled = (
        pool_pair(torch.stack([kv[0::2], kv[1::2]]), torch.stack([gate[0::2], gate[1::2]]))
        if rate == 2
        else kv
    )
    inv = rope_inv_freq(ROPE_DIM, COMPRESS_THETA, None)
    keys = apply_rope(
        rms_norm(pooled, indexer.kv_norm.weight, EPS), torch.arange(groups) * rate, inv
    )
    q = apply_rope((qr[0] @ indexer.q_b_proj.weight.T).view(t, N_HEADS, HEAD_DIM), positions, inv)
    weights = (x @ indexer.scorer.weights_proj.weight.T) * (HEAD_DIM * N_HEADS) ** -0.5
    scores = index_scores(q, weights, keys)
    n_visible = (positions + 1) // rate
    allowed = torch.arange(groups)[None, :] < n_visible[:, None]
    ours = select_topk(scores, allowed, topk)

    theirs = torch.zeros_like(ours)
    for row, picks in enumerate(hf_top):
        theirs[row, picks[picks >= 0]] = True
    # ReLU makes exact ties (score 0) common, and tie order is each side's own choice:
    # both must pick groups with the same scores; where the k-th place is not a near-tie,
    # the very same groups.
    for row in range(t):
        assert torch.equal(
            scores[row][ours[row]].sort().values, scores[row][theirs[row]].sort().values
        ), row
    ranked = scores.masked_fill(~allowed, float("-inf")).sort(-1, descending=True).values
    clear = (n_visible <= topk) | (ranked[:, topk - 1] - ranked[:, min(topk, groups - 1)] > 1e-4)
    assert clear.sum() >= t // 2 and (n_visible > topk).any() and (n_visible <= topk).any()
    assert torch.equal(ours[clear], theirs[clear])


# --- candidate blocks: emulation of upstream's V4.1 kernels -----------------------------
def _emulate_select_candidate_blocks(
    logits: torch.Tensor, ends: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """Block ids [rows, topk_blocks], -1 padded, as upstream's select_candidate_blocks
    (candidate_blocks.py:141-189) computes them for rows starting at column 0:
    * _block_scores_kernel (:15-51): a block's score is the max of its columns below the
      row's end (-inf past it, :37-45); the block holding column end-1 is pinned to +inf
      when end > 0 (:46-50);
    * torch topk over the block scores, min(topk_blocks, nblocks) of them (:180);
    * _store_candidates_kernel (:54-74): a pick whose score is -inf is stored as -1, and
      slots past the available blocks are -1 (:67-68)."""
    rows, width = logits.shape
    nblocks = -(-width // block_size)
    cols = torch.arange(nblocks * block_size)
    padded = torch.full((rows, nblocks * block_size), float("-inf"), dtype=logits.dtype)
    padded[:, :width] = logits
    padded = padded.masked_fill(cols[None, :] >= ends[:, None], float("-inf"))
    scores = padded.view(rows, nblocks, block_size).amax(-1)
    for r in range(rows):
        if ends[r] > 0:
            scores[r, (int(ends[r]) - 1) // block_size] = float("inf")
    top = scores.topk(min(topk_blocks, nblocks), dim=-1)
    out = torch.full((rows, topk_blocks), -1, dtype=torch.long)
    out[:, : top.indices.shape[1]] = torch.where(top.values != float("-inf"), top.indices, -1)
    return out


def _emulate_apply_candidate_mask(
    logits: torch.Tensor, ends: torch.Tensor, candidates: torch.Tensor, block_size: int
) -> torch.Tensor:
    """apply_candidate_mask (candidate_blocks.py:192-235) for rows starting at column 0:
    _candidate_flags_kernel (:77-105) flags each listed block (ids < 0 skipped; an id
    whose first column is past the width flags the 'edge' slot nblocks instead, :103);
    _mask_candidates_kernel (:108-138) keeps a column if it is below the row's end and
    its block is flagged (or it is the last column and the edge slot is flagged) and
    sets every other column to -inf."""
    rows, width = logits.shape
    nblocks = -(-width // block_size)
    flags = torch.zeros(rows, nblocks + 1, dtype=torch.bool)
    for r in range(rows):
        for b in candidates[r].tolist():
            if b >= 0:
                flags[r, nblocks if b * block_size >= width else b] = True
    cols = torch.arange(width)
    keep = flags[:, cols // block_size] | ((cols == width - 1)[None, :] & flags[:, nblocks:])
    valid = cols[None, :] < ends[:, None]
    return logits.masked_fill(~(valid & keep), float("-inf"))


def _emulate_row_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The row top-k that follows (sparse_attn_indexer.py:711-720,
    ops.top_k_per_row_prefill, CUDA): the k largest finite logits of each row; as a
    boolean [rows, width] selection."""
    top = logits.topk(min(k, logits.shape[1]), dim=-1)
    selected = torch.zeros(logits.shape, dtype=torch.bool)
    selected.scatter_(1, top.indices, top.values > float("-inf"))
    return selected


def _blocks_as_mask(
    block_ids: torch.Tensor, ends: torch.Tensor, width: int, block_size: int
) -> torch.Tensor:
    cols = torch.arange(width)
    in_block = (cols[None, None, :] // block_size == block_ids[:, :, None]).any(1)
    return in_block & (cols[None, :] < ends[:, None])


def _rows(seed: int, width: int):
    """Continuous scores (no ties) and visible lengths covering: nothing visible, one
    position, a partial last block, exactly a block boundary, everything."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(12, width, generator=g, dtype=torch.float64)
    ends = torch.tensor([0, 1, 3, 4, 5, 8, 9, 13, 16, 20, 27, width])
    return scores, ends


@pytest.mark.parametrize(
    "width,block_size,topk_blocks",
    [
        (29, 4, 3),  # partial last block
        (32, 8, 2),  # width a multiple of the block
        (10, 4, 5),  # more candidate slots than blocks
    ],
)
@torch.no_grad()
def test_candidate_blocks_match_upstream_select_candidate_blocks(width, block_size, topk_blocks):
    """The candidate source's blocks: best blocks by max visible score, the newest visible
    block always included, blocks with nothing visible never."""
    scores, ends = _rows(4, width)
    ends = ends.clamp(max=width)

    block_ids = _emulate_select_candidate_blocks(scores, ends, topk_blocks, block_size)
    expected = _blocks_as_mask(block_ids, ends, width, block_size)

    ours = candidate_blocks(scores, ends, block_size, topk_blocks)
    assert (block_ids == -1).any() and (block_ids >= 0).any()
    assert torch.equal(ours, expected)


@torch.no_grad()
def test_newest_block_pin_is_exercised():
    """A row whose newest block scores lowest still keeps it (both sides); without the pin
    that block would be dropped -- so the candidate test above can fail on the pin."""
    block_size, topk_blocks = 4, 2
    scores = torch.tensor([[5.0, 5, 5, 5, 4, 4, 4, 4, 3, 3, 3, 3, -9]], dtype=torch.float64)
    ends = torch.tensor([13])
    block_ids = _emulate_select_candidate_blocks(scores, ends, topk_blocks, block_size)
    assert sorted(block_ids[0].tolist()) == [0, 3]
    ours = candidate_blocks(scores, ends, block_size, topk_blocks)
    assert torch.equal(ours, _blocks_as_mask(block_ids, ends, 13, block_size))


@pytest.mark.parametrize(
    "width,block_size,topk_blocks,index_topk",
    [
        (29, 4, 3, 6),
        (40, 8, 2, 12),
        (12, 4, 5, 3),  # every block is a candidate: the filter must change nothing
    ],
)
@torch.no_grad()
def test_two_level_selection_matches_upstream(width, block_size, topk_blocks, index_topk):
    """V4.1's two-level filter: the candidate source publishes blocks from its own scores;
    a later indexer keeps only positions inside them and takes its top-k there. Ours:
    select_topk(consumer scores, visible & candidate_blocks(source scores)), as
    V41Indexer.select composes it."""
    source, ends = _rows(5, width)
    consumer = torch.randn(
        source.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64
    )
    ends = ends.clamp(max=width)

    block_ids = _emulate_select_candidate_blocks(source, ends, topk_blocks, block_size)
    expected = _emulate_row_topk(
        _emulate_apply_candidate_mask(consumer, ends, block_ids, block_size), index_topk
    )

    visible = torch.arange(width)[None, :] < ends[:, None]
    allowed = visible & candidate_blocks(source, ends, block_size, topk_blocks)
    ours = select_topk(consumer, allowed, index_topk)
    if topk_blocks < -(-width // block_size):  # the restriction matters here
        assert not torch.equal(select_topk(consumer, visible, index_topk), expected)
    assert torch.equal(ours, expected)


@torch.no_grad()
def test_short_context_selects_every_visible_group():
    """When no row has more groups than index_topk, upstream skips scoring and fills each
    row with 0 .. (p + 1) // ratio - 1 (_fill_short_context_topk_indices,
    vllm/models/deepseek_v41/attention.py:104-121, used at :1480-1505); ours selects all
    allowed positions."""
    ratio, index_topk, t = 2, 8, 15
    positions = torch.arange(t)
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(t, t // ratio, generator=g)
    n_visible = (positions + 1) // ratio
    allowed = torch.arange(t // ratio)[None, :] < n_visible[:, None]
    expected = torch.zeros_like(allowed)
    for row, p in enumerate(positions.tolist()):
        expected[row, : (p + 1) // ratio] = True
    assert torch.equal(select_topk(scores, allowed, index_topk), expected)
