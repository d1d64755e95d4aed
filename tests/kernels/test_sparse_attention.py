"""The plugin's C kernel for V4.1's sparse attention (kernels/sparse_attention.py) against
its torch twin: each query's keys gathered from the paged caches with the plugin's own
addressing (kv_cache/paged.py), then `sink_attention`, for the SIMD build of this CPU and
a baseline build that runs the portable code."""

import platform

import pytest
import torch

from vllm_deepinfer.kernels import cpu_build, sparse_attention
from vllm_deepinfer.model.deepseek_v41.attention import sink_attention
from vllm_deepinfer.model.deepseek_v41.indexer import index_scores

pytestmark = pytest.mark.unit


def _x86_builds() -> list[str]:
    """The portable baseline, and the AVX2 + FMA vector loops where this CPU runs them
    (on an AVX-512 machine the native build takes the AVX-512 ones)."""
    if platform.machine() != "x86_64":
        return []
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    return ["x86-64"] + (["haswell"] if {"avx2", "fma"} <= set(flags) else [])


BUILDS = [cpu_build.NATIVE] + _x86_builds()
BLOCK_SIZE, W = 16, 8


def built(march: str):
    library = sparse_attention.library(march)
    if library is None:
        pytest.skip("no C compiler on this machine: the kernel is not built")
    return library


class Cache:
    """A bound cache [blocks, 1, rows, D] with its own shuffled block table, as vLLM
    hands the plugin's PagedCache one (blocks of requests interleaved)."""

    def __init__(self, requests, blocks_each, d, dtype, tokens_per_row, g):
        rows = BLOCK_SIZE // tokens_per_row
        total = requests * blocks_each + 3  # unused blocks hold garbage too
        self.kv = torch.randn(total, 1, rows, d, generator=g).to(dtype)
        order = torch.randperm(total, generator=g)[: requests * blocks_each]
        self.table = order.view(requests, blocks_each).contiguous()
        self.tokens_per_row = tokens_per_row

    def row(self, request: int, position: int) -> torch.Tensor:
        block = self.table[request, position // BLOCK_SIZE]
        return self.kv[block, 0, (position % BLOCK_SIZE) // self.tokens_per_row]

    def view(self):
        return sparse_attention.view(self.kv, self.table, BLOCK_SIZE, self.tokens_per_row)


def twin(q, request, position, first, window, compressed, ratio, groups, valid, sink, scale):
    """Each query alone: its valid compressed keys in selection order, then its window
    from max(pos - W + 1, first, 0), through `sink_attention` in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        r, pos = int(request[t]), int(position[t])
        keys = []
        if compressed is not None:
            keys += [compressed.row(r, int(g) * ratio) for g, ok in zip(groups[t], valid[t]) if ok]
        start = max(pos - W + 1, int(first[r]), 0)
        keys += [window.row(r, p) for p in range(start, pos + 1)]
        k = torch.stack(keys).double()
        mask = torch.ones(1, k.shape[0], dtype=torch.bool)
        out[t] = sink_attention(q[t : t + 1].double(), k, mask, sink.double(), scale)[0]
    return out


def case(tokens, heads, d, dtype, ratio, topk, seed):
    g = torch.Generator().manual_seed(seed)
    requests, blocks_each = 3, 4
    window = Cache(requests, blocks_each, d, dtype, 1, g)
    compressed = Cache(requests, blocks_each, d, dtype, ratio, g) if topk else None
    request = torch.randint(0, requests, (tokens,), generator=g)
    position = torch.randint(0, blocks_each * BLOCK_SIZE, (tokens,), generator=g)
    first = torch.tensor([0, 5, 40])  # request 1 and 2 replayed from 5 and 40
    position = torch.maximum(position, first[request])
    groups = valid = None
    if topk:
        complete = (position + 1) // ratio
        groups = (torch.rand(tokens, topk, generator=g) * complete[:, None].clamp_min(1)).long()
        valid = (torch.rand(tokens, topk, generator=g) < 0.8) & (complete[:, None] > 0)
    q = torch.randn(tokens, heads, d, generator=g).to(dtype)
    sink = torch.randn(heads, generator=g)
    return q, request, position, first, window, compressed, groups, valid, sink


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,heads,ratio,topk",
    [(1, 4, 0, 0), (1, 3, 2, 5), (7, 4, 4, 3), (5, 6, 2, 4), (33, 2, 1, 6)],
)
def test_kernel_equals_each_query_on_its_own_keys(march, dtype, tokens, heads, ratio, topk):
    library = built(march)
    d, scale = 64, 64**-0.5
    q, request, position, first, window, compressed, groups, valid, sink = case(
        tokens, heads, d, dtype, ratio, topk, seed=tokens + topk
    )
    got = sparse_attention.attend(
        q, request, position, first, window.view(), W,
        compressed.view() if compressed else None, ratio, groups, valid, sink, scale, library,
    )  # fmt: skip
    expected = twin(
        q, request, position, first, window, compressed, ratio, groups, valid, sink, scale
    )
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_a_result_does_not_depend_on_the_batch():
    """Each query computed alone, in one order: the same bits alone (its heads split
    across threads) as in a batch (each query's heads on one thread)."""
    q, request, position, first, window, compressed, groups, valid, sink = case(
        9, 10, 64, torch.float32, 2, 4, seed=3
    )
    args = (window.view(), W, compressed.view(), 2)
    batch = sparse_attention.attend(
        q, request, position, first, *args, groups, valid, sink, 0.125, built(cpu_build.NATIVE)
    )
    for t in (0, 4, 8):
        alone = sparse_attention.attend(
            q[t : t + 1], request[t : t + 1], position[t : t + 1], first, *args,
            groups[t : t + 1], valid[t : t + 1], sink, 0.125,
        )  # fmt: skip
        assert torch.equal(alone[0], batch[t])


def test_a_query_with_only_its_sink_attends_to_nothing():
    """No visible key (its window starts after it): all weight on the sink, output 0, as
    the torch path's fully masked softmax gives."""
    q, request, position, first, window, *_ = case(1, 2, 64, torch.float32, 0, 0, seed=5)
    out = sparse_attention.attend(
        q, request, position, torch.full((3,), int(position[0]) + 1), window.view(), W, None, 0, None, None,
        torch.zeros(2), 0.125, built(cpu_build.NATIVE),
    )  # fmt: skip
    assert torch.equal(out, torch.zeros_like(out))


def test_a_position_outside_the_block_table_is_refused():
    """A position past the request's blocks fails the call with which token, instead of
    reading memory the table does not give it."""
    q, request, position, first, window, *_ = case(3, 2, 64, torch.float32, 0, 0, seed=6)
    position[1] = 4 * BLOCK_SIZE + 2
    with pytest.raises(IndexError, match="token 1"):
        sparse_attention.attend(
            q, request, position, first, window.view(), W, None, 0, None, None,
            torch.zeros(2), 0.125, built(cpu_build.NATIVE),
        )  # fmt: skip


def test_caches_the_kernel_does_not_read():
    kv = torch.zeros(2, 1, 16, 64)
    assert sparse_attention.reads(kv) and sparse_attention.reads(kv.bfloat16())
    assert not sparse_attention.reads(kv.to(torch.uint8))  # quantized records
    assert not sparse_attention.reads(kv.half())
    assert not sparse_attention.reads(kv.transpose(2, 3))


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,ratio,rows", [(4, 2, 1), (6, 1, 5), (3, 4, 9)])
def test_index_scores_equal_the_gathered_keys_scores(march, dtype, heads, ratio, rows):
    """Each row's scores over its request's visible compressed groups against the
    indexer's torch `index_scores` on the keys gathered by position; 0 past them."""
    library = built(march)
    g = torch.Generator().manual_seed(heads * rows)
    d, requests, blocks_each = 32, 3, 4
    keys = Cache(requests, blocks_each, d, dtype, ratio, g)
    tokens_in_step = 12
    q = torch.randn(tokens_in_step, heads, d, generator=g).to(dtype)
    weights = torch.randn(tokens_in_step, heads, generator=g)
    tokens = torch.randint(0, tokens_in_step, (rows,), generator=g)
    request = torch.randint(0, requests, (rows,), generator=g)
    groups = blocks_each * BLOCK_SIZE // ratio
    visible = torch.randint(0, groups + 1, (rows,), generator=g)
    got = sparse_attention.index_scores(
        q, weights, tokens, request, visible, groups, keys.view(), ratio, library
    )
    assert got.shape == (rows, groups) and got.dtype == torch.float32
    for i in range(rows):
        n = int(visible[i])
        gathered = [keys.row(int(request[i]), j * ratio) for j in range(n)]
        if n:
            expected = index_scores(
                q[tokens[i]][None].double(),
                weights[tokens[i]][None].double(),
                torch.stack(gathered).double(),
            )[0]
            torch.testing.assert_close(got[i, :n].double(), expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[i, n:], torch.zeros(groups - n))


def test_index_scores_outside_the_block_table_are_refused():
    g = torch.Generator().manual_seed(0)
    keys = Cache(1, 2, 32, torch.float32, 1, g)
    with pytest.raises(IndexError, match="row 1"):
        sparse_attention.index_scores(
            torch.randn(2, 2, 32), torch.randn(2, 2), torch.tensor([0, 1]),
            torch.tensor([0, 0]), torch.tensor([3, 2 * BLOCK_SIZE + 1]), 2 * BLOCK_SIZE + 1,
            keys.view(), 1, built(cpu_build.NATIVE),
        )  # fmt: skip


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("heads", [4, 6])
def test_bf16_queries_and_outputs_give_the_bits_of_fp32_ones(march, heads):
    """A bf16 model's layer hands bf16 queries and output rows: the kernel widens the
    queries and rounds its outputs itself, to the very bits of an fp32 call followed by
    torch's conversion; an fp16 output (no kernel dtype) gets them copied in."""
    library = built(march)
    q, request, position, first, window, compressed, groups, valid, sink = case(
        9, heads, 64, torch.bfloat16, 2, 4, seed=11
    )
    args = (request, position, first, window.view(), W, compressed.view(), 2, groups, valid)
    expected = sparse_attention.attend(q.float(), *args, sink, 0.125, library)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.full(q.shape, 7.0, dtype=dtype)
        got = sparse_attention.attend(q, *args, sink, 0.125, library, out=out)
        assert got is out
        assert torch.equal(out, expected.to(dtype))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Values as their bits, every NaN one value (torch's own conversions write different
    NaN bits on their vector and scalar paths)."""
    bits = t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)
    return torch.where(t.isnan(), -1, bits)


def _cache_with_slots(cache_dtype, tokens_per_row, seed):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(5, 1, BLOCK_SIZE // tokens_per_row, 24, generator=g).to(cache_dtype)
    slots = torch.tensor([3, -1, 17, 79, 40, 41, -1, 64])
    rows = torch.randn(len(slots), 24, generator=g) * 300
    rows[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    rows[2, :2] = torch.tensor([1.00390625, 1.01171875])  # bf16 ties: to even, both ways
    return kv, slots, rows


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens_per_row", [1, 2])
def test_written_rows_equal_the_indexed_assignment(march, cache_dtype, rows_dtype, tokens_per_row):
    """write_rows against PagedCache.write's torch path, the indexed assignment: each row
    at (slot / block size, slot % block size / tokens per row), converted as torch
    converts (ties to even, infinities kept), slots of -1 skipped, every other row of
    the cache untouched."""
    kv, slots, rows = _cache_with_slots(cache_dtype, tokens_per_row, seed=1)
    rows = rows.to(rows_dtype)
    expected = kv.clone()
    keep = slots >= 0
    kept = slots[keep]
    expected[kept // BLOCK_SIZE, 0, (kept % BLOCK_SIZE) // tokens_per_row] = rows[keep].to(
        cache_dtype
    )
    sparse_attention.write_rows(kv, BLOCK_SIZE, tokens_per_row, slots, rows, built(march))
    assert torch.equal(_bits(kv), _bits(expected))


@pytest.mark.parametrize("count", [1, 9, 37])
def test_every_row_of_a_long_write_lands(count):
    """Writes of fewer and more rows than the kernel fetches ahead (8): each row at its
    own slot, in order, padding skipped."""
    g = torch.Generator().manual_seed(count)
    kv = torch.randn(5, 1, BLOCK_SIZE, 24, generator=g)
    slots = torch.randperm(5 * BLOCK_SIZE, generator=g)[:count]
    slots[::5] = -1
    rows = torch.randn(count, 24, generator=g)
    expected = kv.clone()
    kept = slots[slots >= 0]
    expected[kept // BLOCK_SIZE, 0, kept % BLOCK_SIZE] = rows[slots >= 0]
    sparse_attention.write_rows(kv, BLOCK_SIZE, 1, slots, rows, built(cpu_build.NATIVE))
    assert torch.equal(kv, expected)


def test_rows_with_a_stride_are_written_as_they_read():
    """A step's rows are often a slice of a wider tensor (the compressor's latent and
    gate halves): each row is read at its own stride."""
    kv, slots, rows = _cache_with_slots(torch.float32, 1, seed=2)
    wide = torch.cat([rows, -rows], dim=1)
    expected = kv.clone()
    sparse_attention.write_rows(expected, BLOCK_SIZE, 1, slots, rows.contiguous())
    sparse_attention.write_rows(kv, BLOCK_SIZE, 1, slots, wide[:, :24], built(cpu_build.NATIVE))
    assert torch.equal(_bits(kv), _bits(expected))


def test_a_slot_outside_the_cache_is_refused():
    """The rows before the first slot outside the cache are written, none from it on
    (the kernel fetches destination rows ahead of its writes)."""
    kv, slots, rows = _cache_with_slots(torch.float32, 1, seed=3)
    slots[4] = 5 * BLOCK_SIZE
    expected = kv.clone()
    before = slots[:4][slots[:4] >= 0]
    expected[before // BLOCK_SIZE, 0, before % BLOCK_SIZE] = rows[:4][slots[:4] >= 0]
    with pytest.raises(IndexError, match=f"slot {5 * BLOCK_SIZE}"):
        sparse_attention.write_rows(kv, BLOCK_SIZE, 1, slots, rows, built(cpu_build.NATIVE))
    assert torch.equal(_bits(kv), _bits(expected))


def test_rows_and_slots_of_different_counts_are_refused():
    """Each slot takes the row at its index: fewer rows than slots would read past them."""
    kv, slots, rows = _cache_with_slots(torch.float32, 1, seed=5)
    before = kv.clone()
    with pytest.raises(ValueError, match="7 rows for 8 slots"):
        sparse_attention.write_rows(kv, BLOCK_SIZE, 1, slots, rows[:7], built(cpu_build.NATIVE))
    assert torch.equal(kv, before)


def test_a_cache_writes_through_the_kernel_where_it_takes_the_rows(monkeypatch):
    """PagedCache.write gives the same cache through the kernel and through its torch
    path (DEEPINFER_ATTENTION_KERNEL=torch), and keeps the torch path for rows the
    kernel does not take (fp16) and for quantized records."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_deepinfer.kv_cache.paged import PagedCache

    built(cpu_build.NATIVE)
    kv, slots, rows = _cache_with_slots(torch.bfloat16, 2, seed=4)
    md = SimpleNamespace(block_size=BLOCK_SIZE, tokens_per_state=2)
    results = {}
    for setting in ("auto", "torch"):
        monkeypatch.setenv("DEEPINFER_ATTENTION_KERNEL", setting)
        sparse_attention.enabled.cache_clear()
        with set_current_vllm_config(VllmConfig()):
            cache = PagedCache(f"layers.0.check_{setting}", spec=None)
        cache.bind_kv_cache(kv.clone())
        assert sparse_attention.writes(cache, rows) == (setting == "auto")
        cache.write(md, slots, rows)
        results[setting] = cache.kv_cache
    monkeypatch.setenv("DEEPINFER_ATTENTION_KERNEL", "auto")
    sparse_attention.enabled.cache_clear()
    assert torch.equal(_bits(results["auto"]), _bits(results["torch"]))
    assert sparse_attention.writes(cache, rows) and sparse_attention.writes(cache, rows.bfloat16())
    assert not sparse_attention.writes(cache, rows.half())
    cache.bind_kv_cache(kv.view(torch.uint8))
    assert not sparse_attention.writes(cache, rows)
    cache.bind_kv_cache(kv.clone())
    cache.record = object()  # quantized records: encoded by the torch path
    assert not sparse_attention.writes(cache, rows)
