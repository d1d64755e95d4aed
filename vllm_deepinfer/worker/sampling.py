"""Deterministic sampling on a V1 runner (DEEPINFER_DETERMINISTIC_SAMPLING=1): before each
step the generator of every seeded row is re-seeded from (seed, position of the token
drawn), and verification goes through the position-keyed rejection sampler
(determinism/sampling.py says why)."""

from __future__ import annotations

import functools

import torch

from vllm_deepinfer.determinism.sampling import PositionKeyedRejectionSampler, position_seed


def install(runner) -> None:
    """Keys the seeded draws of `runner` (vLLM's V1 GPU/CPU model runner) by position."""
    if getattr(runner, "_deepinfer_keyed_sampling", False):
        return
    if getattr(runner, "rejection_sampler", None) is not None:
        runner.rejection_sampler.__class__ = PositionKeyedRejectionSampler
        runner.rejection_sampler.row_keys = {}
    sample = runner._sample

    @functools.wraps(sample)
    def keyed_sample(logits, spec_decode_metadata):
        keys = _row_keys(runner, spec_decode_metadata)
        generators = runner.input_batch.sampling_metadata.generators
        for row, (seed, first_position) in keys.items():
            bonus = (
                0 if spec_decode_metadata is None else spec_decode_metadata.num_draft_tokens[row]
            )
            generators[row].manual_seed(position_seed(seed, first_position + bonus))
        if spec_decode_metadata is not None:
            runner.rejection_sampler.row_keys = keys
        return sample(logits, spec_decode_metadata)

    runner._sample = keyed_sample
    runner._deepinfer_keyed_sampling = True


def _row_keys(runner, spec_decode_metadata) -> dict[int, tuple[int, int]]:
    """Seeded request rows -> (seed, position of the first token sampled this step)."""
    batch = runner.input_batch
    generators = batch.sampling_metadata.generators
    if not generators:
        return {}
    if spec_decode_metadata is None:
        last_token = runner.query_start_loc.cpu[1 : batch.num_reqs + 1].to(torch.int64) - 1
    else:
        first_row = torch.cat(
            [
                torch.zeros(1, dtype=torch.int64),
                spec_decode_metadata.cu_num_sampled_tokens.cpu()[:-1],
            ]
        )
        last_token = spec_decode_metadata.logits_indices.cpu()[first_row]
    positions = runner.positions.cpu()[last_token] + 1
    keys = {}
    for row in generators:
        seed = runner.requests[batch.req_ids[row]].sampling_params.seed
        if seed is not None:
            keys[row] = (seed, int(positions[row]))
    return keys
