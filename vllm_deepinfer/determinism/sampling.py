"""Deterministic sampling (DEEPINFER_DETERMINISTIC_SAMPLING=1): a seeded request's random
draw for a token is keyed by its seed and that token's position, so identical input
tokens and sampling parameters give identical output whatever the batch, after a
restart, and with or without speculative decoding.

vLLM gives each seeded request a generator that advances with every draw, so a draw
depends on how many draws came before: a speculative step draws for each verified
position and a rejection draws more. Here the runner's generator of a seeded row is
re-seeded before each step from (seed, position of the token drawn), and verification
of seeded random rows samples every verified position exactly as a plain decode step
would (the same sampler, the same keyed draw) and accepts a draft only where it equals
that sample: the output is then the one plain decoding gives, token for token.

Needs batch-invariant logits (envs.py refuses it otherwise) and fixed-length
verification (the variable length follows measured step times).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
    rejection_sample,
)
from vllm.v1.sample.sampler import _SAMPLING_EPS as _GREEDY_BELOW

from vllm_deepinfer.determinism.expand import expand_batch_to_tokens

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A generator seed for the draw at `position` of a request seeded `seed`
    (SplitMix64 finalizer of the pair; non-negative, below 2**63)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class PositionKeyedRejectionSampler(RejectionSampler):
    """vLLM's rejection sampler, except for seeded random rows: each verified position is
    sampled as a plain decode step samples it (temperature, top-k/top-p, the sampler's
    draw from a generator keyed to the position), and drafts are accepted while they
    equal those samples. `row_keys` (request row -> (seed, first sampled position)) is set
    by the runner before each verification."""

    row_keys: dict[int, tuple[int, int]] = {}

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        keyed = {i: key for i, key in self.row_keys.items() if i < len(metadata.num_draft_tokens)}
        if sampling_metadata.all_greedy or not keyed:
            return super().forward(metadata, draft_probs, logits, sampling_metadata)
        bonus_output = self.sampler(
            logits=logits[metadata.bonus_logits_indices],
            sampling_metadata=replace(sampling_metadata, max_num_logprobs=-1),
            predict_bonus_token=True,
            logprobs_mode_override=(
                "processed_logits" if self.is_processed_logprobs_mode else "raw_logits"
            ),
        )
        bonus = bonus_output.sampled_token_ids
        raw_target = logits[metadata.target_logits_indices].to(torch.float32)
        target = raw_target if self.is_processed_logprobs_mode else raw_target.clone()
        target = self.apply_logits_processors(target, sampling_metadata, metadata)
        scaled, top_k, top_p = _per_position(target, metadata, sampling_metadata)
        starts = [0, *metadata.cu_num_draft_tokens.tolist()]  # each request's first row
        keyed_samples = self._keyed_samples(scaled, top_k, top_p, metadata, starts, keyed)
        target = apply_top_k_top_p(scaled, top_k, top_p)
        output = rejection_sample(
            metadata.draft_token_ids,
            metadata.num_draft_tokens,
            metadata.max_spec_len,
            metadata.cu_num_draft_tokens,
            draft_probs,
            target,
            bonus,
            sampling_metadata,
            synthetic_mode=self.synthetic_mode,
            synthetic_conditional_rates=self.synthetic_conditional_rates,
            use_fp64_gumbel=self.use_fp64_gumbel,
        )
        self._accept_equal(output, metadata, bonus, keyed_samples, starts, keyed)
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs,
                metadata,
                logits,
                target if self.is_processed_logprobs_mode else raw_target,
                bonus_output.logprobs_tensors.logprobs,
                output,
            )
        return SamplerOutput(sampled_token_ids=output, logprobs_tensors=logprobs)

    def _keyed_samples(self, scaled, top_k, top_p, metadata, starts, keyed) -> torch.Tensor:
        """Each verified position's token as a plain decode step samples it, [tokens]
        (rows of requests not keyed hold -1): `scaled` holds the logits after
        temperature, `top_k`/`top_p` the per-position limits."""
        num_tokens = scaled.shape[0]
        generators = {}
        for request, (seed, first_position) in keyed.items():
            for j in range(metadata.num_draft_tokens[request]):
                generator = torch.Generator(device=scaled.device)
                generator.manual_seed(position_seed(seed, first_position + j))
                generators[starts[request] + j] = generator
        sampled, _ = self.sampler.topk_topp_sampler(scaled.clone(), generators, top_k, top_p)
        keep = torch.full((num_tokens,), -1, dtype=torch.int64, device=scaled.device)
        rows = torch.tensor(sorted(generators), dtype=torch.int64, device=scaled.device)
        keep[rows] = sampled.view(-1).to(torch.int64)[rows]
        return keep

    @staticmethod
    def _accept_equal(output, metadata, bonus, keyed_samples, starts, keyed) -> None:
        """Overwrites the keyed requests' rows: drafts accepted while each equals the
        position's sample; the first that differs is replaced by it; all equal, the
        bonus token follows."""
        drafts = metadata.draft_token_ids.tolist()
        samples = keyed_samples.tolist()
        for request in keyed:
            row = []
            for j in range(metadata.num_draft_tokens[request]):
                token = samples[starts[request] + j]
                row.append(token)
                if token != drafts[starts[request] + j]:
                    break
            else:
                row.append(int(bonus[request, 0]))
            output[request] = PLACEHOLDER_TOKEN_ID
            output[request, : len(row)] = torch.tensor(row, dtype=output.dtype)


def _per_position(target, metadata, sampling_metadata):
    """The verified positions' logits after temperature (as the sampler divides them:
    greedy rows by 1), and their top-k / top-p, each request's repeated per position."""

    def expanded(values):
        return (
            None
            if values is None
            else expand_batch_to_tokens(values, metadata.cu_num_draft_tokens, target.shape[0])
        )

    temperature = expanded(sampling_metadata.temperature)
    temperature = torch.where(temperature < _GREEDY_BELOW, 1.0, temperature)
    return (
        target.div_(temperature.unsqueeze(-1)),
        expanded(sampling_metadata.top_k),
        expanded(sampling_metadata.top_p),
    )
