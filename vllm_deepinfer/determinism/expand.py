"""Per-request values spread over their positions, in torch: what speculative verification
needs for each draft position's temperature, top-k and top-p. Imports nothing from vLLM,
so the patch that puts it in place of vLLM's Triton expansion on the CPU
(patches/cpu_spec_sampling.py) imports on every vLLM, one without Model Runner V1 too."""

from __future__ import annotations

import torch


def expand_batch_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """Each request's value repeated over its positions ([batch] -> [num_tokens]), values
    equal to `replace_from` replaced by `replace_to`; `cu_num_tokens` holds each request's
    cumulative position count."""
    counts = torch.diff(
        cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64)
    )
    values = x.masked_fill(x == replace_from, replace_to)
    return values.repeat_interleave(counts, output_size=num_tokens)
