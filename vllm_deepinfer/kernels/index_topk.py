"""The plugin's C kernel for the lightning indexer's selection on the CPU
(kernels/cpu/index_topk.c): each query's top-k compressed groups, written straight into
the step's rows, and the candidate source's best blocks, from the scores of a request
group. Their torch twins are the indexer's `topk_groups` and `candidate_blocks`
(model/deepseek_v41/indexer.py), a dozen aten calls per request group each. Turned off
with the plugin's other attention kernels (DEEPINFER_ATTENTION_KERNEL=torch)."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from vllm_deepinfer.kernels import cpu_build, sparse_attention


@cache
def library() -> ctypes.CDLL | None:
    """The kernel built for this CPU; None where it cannot be built (cpu_build logs why)."""
    built = cpu_build.load("index_topk")
    if built is None:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    built.index_topk.argtypes = [
        pointer, size, size, pointer, pointer, size, pointer, pointer, pointer, size, ctypes.c_int,
    ]  # fmt: skip
    built.index_topk.restype = ctypes.c_int
    built.candidate_blocks.argtypes = [
        pointer, size, size, pointer, size, size, pointer, ctypes.c_int,
    ]  # fmt: skip
    built.candidate_blocks.restype = ctypes.c_int
    return built


def fits(scores: torch.Tensor) -> bool:
    """Whether the kernel selects from these scores: fp32 CPU rows, the kernel turned on
    and built."""
    return (
        scores.device.type == "cpu"
        and scores.dtype == torch.float32
        and sparse_attention.enabled()
        and library() is not None
    )


def _check(failed: int, kernel: str) -> None:
    if failed:
        raise MemoryError(f"{kernel}: no memory for a thread's buffers")


def select_into(
    scores: torch.Tensor,
    visible: torch.Tensor,
    candidates: torch.Tensor | None,
    k: int,
    tokens: torch.Tensor,
    chosen: torch.Tensor,
    valid: torch.Tensor,
) -> None:
    """Row r of scores [R, G] chooses its min(k, G) best groups below visible[r] (and
    inside candidates [R, G] where given); they land in chosen [T, >= min(k, G)] int64
    and valid (bool, whether each is allowed) at row tokens[r], skipped where it is -1.
    `topk_groups` then a scatter, in one call."""
    rows, groups = scores.shape
    if chosen.dtype != torch.int64 or valid.dtype != torch.bool:
        raise TypeError("index_topk: chosen must be int64 and valid bool")
    if not (chosen.is_contiguous() and valid.is_contiguous()) or chosen.shape != valid.shape:
        raise ValueError("index_topk: chosen and valid must be contiguous, of one shape")
    if chosen.shape[1] < min(k, groups):
        raise ValueError(f"index_topk: {chosen.shape[1]} columns for the top {min(k, groups)}")
    scores = scores.contiguous()
    index = [t.to(torch.int64).contiguous() for t in (visible, tokens)]
    if candidates is not None:
        candidates = candidates.to(torch.bool).contiguous()
    if rows and int(index[1].max()) >= chosen.shape[0]:
        raise IndexError(f"index_topk: a token lies outside the {chosen.shape[0]} rows")
    failed = library().index_topk(
        scores.data_ptr(), rows, groups, index[0].data_ptr(),
        None if candidates is None else candidates.data_ptr(), k, index[1].data_ptr(),
        chosen.data_ptr(), valid.data_ptr(), chosen.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    _check(failed, "index_topk")


def candidate_blocks(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int, top_blocks: int
) -> torch.Tensor:
    """`candidate_blocks` of the indexer: bool [R, G], the positions inside each row's
    best `top_blocks` blocks of `block_size` that it sees."""
    rows, groups = scores.shape
    scores = scores.contiguous()
    seen = visible.to(torch.int64).contiguous()
    keep = torch.empty(rows, groups, dtype=torch.bool)
    failed = library().candidate_blocks(
        scores.data_ptr(), rows, groups, seen.data_ptr(), block_size, top_blocks,
        keep.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _check(failed, "candidate_blocks")
    return keep
