"""The plugin's C kernels for V4.1's sparse attention on the CPU
(kernels/cpu/sparse_attention.c), reading the paged caches in place with no gathered
copy: `attend`, each query over its top-k compressed latents and its window, and
`index_scores`, the lightning indexer's scores over a request's compressed index keys;
and `write_rows`, which stores a step's rows at their slots of a cache.

Their torch twins are the attention layer's tiled path (model/deepseek_v41/attention.py)
and the indexer's gathered keys through `index_scores` (indexer.py), which gather keys
and run dozens of small aten calls per layer: most of a decode step's attention time.
Where the kernel cannot be built, a cache is stored as quantized records or in another
dtype, or DEEPINFER_ATTENTION_KERNEL=torch, the layer keeps its torch path."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from vllm_deepinfer import envs
from vllm_deepinfer.kernels import cpu_build
from vllm_deepinfer.kernels.cpu_build import ROW_DTYPES


class PagedCacheView(ctypes.Structure):
    """kernels/cpu/sparse_attention.c's `paged_cache`: one cache's rows, block table and
    layout, strides in bytes."""

    _fields_ = [
        ("rows", ctypes.c_void_p),
        ("block_stride", ctypes.c_int64),
        ("row_stride", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("table", ctypes.c_void_p),
        ("table_width", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("tokens_per_row", ctypes.c_int64),
        ("dtype", ctypes.c_int32),
    ]


@cache
def library(march: str = cpu_build.NATIVE) -> ctypes.CDLL | None:
    """The kernel built for this CPU (or for `march`); None where it cannot be built."""
    built = cpu_build.load("sparse_attention", march)
    if built is None:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    view = ctypes.POINTER(PagedCacheView)
    built.sparse_attention.argtypes = [
        pointer, ctypes.c_int32, size, size, size, pointer, pointer, pointer, view, size, view,
        size, pointer, pointer, size, pointer, ctypes.c_float, pointer, ctypes.c_int32,
        ctypes.c_int,
    ]  # fmt: skip
    built.sparse_attention.restype = ctypes.c_int
    built.index_scores.argtypes = [
        pointer, pointer, size, size, pointer, pointer, pointer, size, size, view, size,
        pointer, ctypes.c_int,
    ]  # fmt: skip
    built.index_scores.restype = ctypes.c_int
    built.paged_write.argtypes = [view, pointer, size, pointer, ctypes.c_int32, size, size]
    built.paged_write.restype = ctypes.c_int
    return built


@cache
def enabled() -> bool:
    """DEEPINFER_ATTENTION_KERNEL, read once per process."""
    return envs.load().attention_kernel == "auto"


def reads(kv_cache: torch.Tensor) -> bool:
    """Whether the kernel reads this bound cache ([blocks, 1, rows, width], rows
    contiguous): on the CPU, fp32 or bf16 (not quantized records)."""
    return (
        kv_cache.device.type == "cpu"
        and kv_cache.dtype in ROW_DTYPES
        and kv_cache.dim() == 4
        and kv_cache.stride(-1) == 1
    )


def reads_cache(cache) -> bool:
    """Whether the kernel reads this PagedCache (kv_cache/paged.py): rows in the model
    dtype, not quantized records, bound as `reads` takes them."""
    return cache.record is None and reads(cache.kv_cache)


def cache_view(cache, md) -> PagedCacheView:
    """`view` of a PagedCache with its step metadata (kv_cache/paged.py)."""
    return view(cache.kv_cache, md.block_table, md.block_size, md.tokens_per_state)


def usable() -> bool:
    """The kernel is turned on and built for this CPU."""
    return enabled() and library() is not None


def view(
    kv_cache: torch.Tensor, block_table: torch.Tensor, block_size: int, tokens_per_row: int
) -> PagedCacheView:
    """The kernel's description of a bound cache and its block table (int64, contiguous:
    both must outlive the call)."""
    if block_table.dtype != torch.int64 or not block_table.is_contiguous():
        raise ValueError("sparse_attention: block tables must be contiguous int64")
    size = kv_cache.element_size()
    return PagedCacheView(
        kv_cache.data_ptr(),
        kv_cache.stride(0) * size,
        kv_cache.stride(2) * size,
        kv_cache.shape[0],
        block_table.data_ptr(),
        block_table.shape[1],
        block_size,
        tokens_per_row,
        ROW_DTYPES[kv_cache.dtype],
    )


def _check(failed: int, kernel: str, item) -> None:
    """A kernel's return code as an error: -1, no memory; i + 1, item i's keys (`item(i)`
    names it) lie outside its block table."""
    if failed == -1:
        raise MemoryError(f"{kernel}: no memory for a thread's buffers")
    if failed:
        raise IndexError(f"{kernel}: the keys of {item(failed - 1)} lie outside its block table")


def attend(
    q: torch.Tensor,
    request: torch.Tensor,
    position: torch.Tensor,
    first: torch.Tensor,
    window: PagedCacheView,
    window_size: int,
    compressed: PagedCacheView | None,
    ratio: int,
    groups: torch.Tensor | None,
    valid: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
    built: ctypes.CDLL | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output [T, heads, D] for queries q [T, heads, D] (computed in fp32): token
    t of request `request[t]` at `position[t]` reads its window from `first[request[t]]`
    on and, where `compressed` is given, the groups `groups[t]` [T, k] marked `valid`.
    Written into `out` where given (in place when it is contiguous fp32 or bf16: the
    kernel rounds as a copy would), which is returned; else returned in fp32. `built`
    picks a library other than this CPU's (tests)."""
    built = built or library()
    if built is None:
        raise RuntimeError("the sparse_attention kernel is not built on this machine")
    tokens, heads, d = q.shape
    queries = q if q.dtype in ROW_DTYPES else q.to(torch.float32)
    queries = queries.contiguous()
    result = out
    if out is None or out.dtype not in ROW_DTYPES or not out.is_contiguous():
        result = torch.empty(tokens, heads, d, dtype=torch.float32)
    index = [t.to(torch.int64).contiguous() for t in (request, position, first)]
    topk = 0 if compressed is None else groups.shape[1]
    if topk:
        groups = groups.to(torch.int64).contiguous()
        valid = valid.to(torch.uint8).contiguous()
    sinks = sink.to(torch.float32).contiguous()
    failed = built.sparse_attention(
        queries.data_ptr(), ROW_DTYPES[queries.dtype], tokens, heads, d,
        *(t.data_ptr() for t in index), ctypes.byref(window), window_size,
        ctypes.byref(compressed) if topk else None, ratio,
        groups.data_ptr() if topk else None, valid.data_ptr() if topk else None, topk,
        sinks.data_ptr(), scale, result.data_ptr(), ROW_DTYPES[result.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    _check(
        failed,
        "sparse_attention",
        lambda t: f"token {t} (request {int(request[t])}, position {int(position[t])})",
    )
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result


def index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    tokens: torch.Tensor,
    requests: torch.Tensor,
    visible: torch.Tensor,
    groups: int,
    keys: PagedCacheView,
    ratio: int,
    built: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Scores [rows, groups] fp32: row i scores token `tokens[i]`'s queries q [T, nI, dI]
    (head weights [T, nI]) against request `requests[i]`'s compressed index keys of the
    groups below `visible[i]` (0 beyond them)."""
    built = built or library()
    if built is None:
        raise RuntimeError("the sparse_attention kernel is not built on this machine")
    heads, d = q.shape[1], q.shape[2]
    qf = q.to(torch.float32).contiguous()
    wf = weights.to(torch.float32).contiguous()
    index = [t.to(torch.int64).contiguous() for t in (tokens, requests, visible)]
    rows = index[0].shape[0]
    scores = torch.empty(rows, groups, dtype=torch.float32)
    failed = built.index_scores(
        qf.data_ptr(), wf.data_ptr(), heads, d, *(t.data_ptr() for t in index), rows, groups,
        ctypes.byref(keys), ratio, scores.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _check(failed, "index_scores", lambda i: f"row {i} (request {int(requests[i])})")
    return scores


_NO_TABLE = torch.empty(1, 0, dtype=torch.int64)
"""The block table of a write's view: writes address blocks by slot, not by request."""


def writes(cache, rows: torch.Tensor) -> bool:
    """Whether `write_rows` stores these rows in this PagedCache: the kernel usable, a
    cache it reads (`reads_cache`), rows [N, width] of the cache's width in fp32 or bf16,
    each contiguous."""
    return (
        usable()
        and reads_cache(cache)
        and rows.device.type == "cpu"
        and rows.dim() == 2
        and rows.dtype in ROW_DTYPES
        and rows.stride(-1) == 1
        and rows.shape[1] == cache.kv_cache.shape[-1]
    )


def write_rows(
    kv_cache: torch.Tensor,
    block_size: int,
    tokens_per_row: int,
    slots: torch.Tensor,
    rows: torch.Tensor,
    built: ctypes.CDLL | None = None,
) -> None:
    """Stores rows [N, width] at token slots [N] of a bound cache (`reads`), converted to
    its dtype as torch converts; slot -1 is skipped. The torch twin is PagedCache.write's
    indexed assignment (kv_cache/paged.py)."""
    built = built or library()
    if built is None:
        raise RuntimeError("the sparse_attention kernel is not built on this machine")
    if rows.shape[0] != slots.shape[0]:
        raise ValueError(f"paged_write: {rows.shape[0]} rows for {slots.shape[0]} slots")
    if kv_cache.shape[2] * tokens_per_row < block_size:
        raise ValueError(
            f"paged_write: {kv_cache.shape[2]} rows a block cannot hold {block_size} tokens "
            f"at {tokens_per_row} a row"
        )
    slots = slots.to(torch.int64).contiguous()
    cache = view(kv_cache, _NO_TABLE, block_size, tokens_per_row)
    failed = built.paged_write(
        ctypes.byref(cache), slots.data_ptr(), slots.shape[0], rows.data_ptr(),
        ROW_DTYPES[rows.dtype], rows.stride(0) * rows.element_size(), rows.shape[1],
    )  # fmt: skip
    if failed:
        slot = int(slots[failed - 1])
        raise IndexError(f"paged_write: slot {slot} lies outside the cache's blocks")
