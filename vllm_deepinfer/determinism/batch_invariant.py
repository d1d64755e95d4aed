"""Batch-invariant numerics: the same request gets bit-identical results whatever shares
its step, wherever it sits in the batch and however its prompt was chunked.

Dynamic batching changes results through kernels whose arithmetic follows the shapes they
are given: a matrix multiply picks its blocking (and, for few rows, another kernel
altogether) from the number of rows, a batched one its threading from the number of
entries, and on the CPU a SIMD elementwise kernel computes exp/sigmoid/silu of each
thread's leftover elements with scalar code whose last bit differs. So every reduction
of the model is given shapes that do not depend on the batch: matrix multiplies run on
fixed tiles of ROW_TILE rows and batched ones on chunks of ROW_TILE entries of a fixed
shape and layout, through the `.out` forms of the aten ops (which the CPU overrides in
`cpu_ops.py` leave alone), small contractions are unrolled in a fixed order, and
transcendental elementwise functions run on whole SIMD multiples (`pointwise`).
Row-wise reductions (norms, softmax) already run one row at a time, each row alike.

On a GPU `linear` is the fixed-tile Triton kernel `kernels/fixed_tile_matmul.py`, whose
torch twin is the CPU path here.

Switched on by DEEPINFER_BATCH_INVARIANT=1 or vLLM's own VLLM_BATCH_INVARIANT=1."""

from __future__ import annotations

import math
import os

import torch

from vllm_deepinfer import envs

ROW_TILE = 16
"""Rows of every matrix-multiply call (and entries of every batched one): one tile shape
for every batch. 16 rows gave bit-identical rows on the CPU at every position of the
tile for the shapes measured, and costs little where decode steps are memory-bound."""

_SWITCHES = ("DEEPINFER_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT")
_cache: tuple[tuple, bool] | None = None
# CPython keeps os.environ's values in an encoded dict: a plain lookup there costs a tenth
# of os.environ.get, and `enabled` runs about 170 times in every decode step.
_ENCODED = getattr(os.environ, "_data", None)
_ENCODED_SWITCHES = (
    tuple(os.environ.encodekey(name) for name in _SWITCHES) if _ENCODED is not None else None
)


def _switches() -> tuple:
    if _ENCODED is None or _ENCODED_SWITCHES is None:
        return tuple(os.environ.get(name) for name in _SWITCHES)
    return tuple(_ENCODED.get(key) for key in _ENCODED_SWITCHES)


def enabled() -> bool:
    """Whether batch-invariant mode is on (checked per call: cheap, and tests switch it).
    Never while vLLM compiles a model: the mode runs V4.1 eager (model.py)."""
    global _cache
    if torch.compiler.is_compiling():
        return False
    key = _switches()
    if _cache is None or _cache[0] != key:
        settings = envs.load()
        _cache = (key, settings.batch_invariant or envs.vllm_batch_invariant())
    return _cache[1]


def follow_deepinfer_switch(on_cpu: bool) -> None:
    """DEEPINFER_BATCH_INVARIANT=1 turns vLLM's own switch on too (in this process and the
    ones it starts), so vLLM's sampler and layers follow; on the CPU the plugin's kernels
    stand in for upstream's Triton ones (patches/batch_invariant_cpu.py).

    On the CPU torch.compile stays off (TORCHDYNAMO_DISABLE=1): Inductor's fused C++
    loops take SIMD tails whose place follows the batch's size (`pointwise` says why
    that matters)."""
    for name, value in process_environment(on_cpu).items():
        if name == "VLLM_BATCH_INVARIANT":
            os.environ[name] = value  # DEEPINFER_BATCH_INVARIANT=1 wins over a 0 here
        else:
            os.environ.setdefault(name, value)


def process_environment(on_cpu: bool) -> dict[str, str]:
    """The variables batch invariance needs in the processes vLLM starts (empty when it
    is off)."""
    if not enabled():
        return {}
    needed = {"VLLM_BATCH_INVARIANT": "1"}
    if on_cpu:
        needed["TORCHDYNAMO_DISABLE"] = "1"
    return needed


def _tile(rows: torch.Tensor) -> torch.Tensor:
    """Fewer than ROW_TILE rows (or entries) zero-padded to ROW_TILE."""
    tile = rows.new_zeros(ROW_TILE, *rows.shape[1:])
    tile[: rows.shape[0]] = rows
    return tile


def row_tiled(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (rows -> rows, one output row per input row) applied to ROW_TILE-row tiles of
    x [..., K] (leading dimensions flattened), so fn always sees the same shape."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    count = rows.shape[0]
    whole = count - count % ROW_TILE
    parts = [fn(rows[i : i + ROW_TILE]) for i in range(0, whole, ROW_TILE)]
    if whole < count:
        parts.append(fn(_tile(rows[whole:]))[: count - whole])
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b through aten's mm.out, which the CPU overrides of mm leave alone (one tile:
    callers tile the rows)."""
    out = a.new_empty(a.shape[0], b.shape[1])
    return torch.ops.aten.mm.out(a, b, out=out)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T on fixed tiles (the Triton kernel on a GPU)."""
    if x.is_cuda:
        from vllm_deepinfer.kernels.fixed_tile_matmul import fixed_tile_linear

        return fixed_tile_linear(x, weight)
    weight_t = weight.to(x.dtype).t()
    return row_tiled(lambda tile: matmul(tile, weight_t), x)


def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T: on fixed tiles (`linear`) in batch-invariant mode, plain otherwise."""
    return linear(x, weight) if enabled() else x @ weight.T


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] for entries whose shape the caller fixes (the model's
    head count, a tile of ROW_TILE rows): every call gets ROW_TILE entries, so an entry's
    result depends on its own operands only, not on how many came with it."""
    # One memory layout for every chunk (a transposed view and a padded copy would take
    # different kernels).
    a, b = a.contiguous(), b.contiguous()
    entries = a.shape[0]
    out = a.new_empty(-(-entries // ROW_TILE) * ROW_TILE, a.shape[1], b.shape[2])
    for i in range(0, entries, ROW_TILE):
        a_chunk, b_chunk = a[i : i + ROW_TILE], b[i : i + ROW_TILE]
        if a_chunk.shape[0] < ROW_TILE:
            a_chunk, b_chunk = _tile(a_chunk), _tile(b_chunk)
        torch.ops.aten.bmm.out(a_chunk, b_chunk, out=out[i : i + ROW_TILE])
    return out[:entries]


POINTWISE_GRAIN = 1 << 15
"""torch runs an elementwise kernel on one thread below this many elements (its parallel
grain)."""
_SIMD_MULTIPLE = 64
"""Elements per call a multiple of this (any SIMD width, unrolled twice): the vectorized
loop then has no leftover elements for its scalar tail."""


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (elementwise: sigmoid, silu, softplus, ...) so that every element takes the same
    code path wherever its row sits: on the CPU torch's SIMD kernels compute the leftover
    elements of a call (or of a thread's range) with scalar libm code whose last bit
    differs. Rows are zero-padded to a whole multiple of the SIMD width and run in
    single-threaded calls; off in normal mode and on other devices."""
    if not enabled() or x.device.type != "cpu" or x.dim() == 0:
        return fn(x)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    count, width = rows.shape
    unit = _SIMD_MULTIPLE // math.gcd(width, _SIMD_MULTIPLE)  # rows per whole multiple
    chunk = max(unit, POINTWISE_GRAIN // width // unit * unit)
    padded = rows.new_zeros(-(-count // unit) * unit, width)
    padded[:count] = rows
    out = torch.cat([fn(padded[i : i + chunk]) for i in range(0, padded.shape[0], chunk)])
    return out[:count].reshape(x.shape)


def weighted_sum(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """sum_j weights[..., j] * values[..., j, :] with j in index order (unrolled: a small
    contraction whose order must not follow the batch). weights [..., J], values
    [..., J, D] -> [..., D]."""
    out = weights[..., 0, None] * values[..., 0, :]
    for j in range(1, weights.shape[-1]):
        out = out + weights[..., j, None] * values[..., j, :]
    return out
