"""vLLM's V1 model runner (CPU or GPU) with the plugin's DSpark proposer.

For `method="dspark"` V1 builds an EAGLE proposer (which would look for a separate draft
model); this runner puts `DSparkProposer` in its place, times each step for the cost
model, hands the proposer the step's scheduler output (which drafts were verified) and
attaches the proposer's counters to the step's output for the scheduler
(spec_decode/dspark/stats.py). Built by the plugin's workers (worker_base.py) when
speculative decoding uses the DSpark stages.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.v1.outputs import ModelRunnerOutput

from vllm_deepinfer.spec_decode.dspark.proposer import DSparkProposer
from vllm_deepinfer.spec_decode.dspark.stats import RUNNER_OUTPUT_ATTR


def build(runner, vllm_config, device: torch.device):
    """A runner of the class vLLM built (`runner`) that drafts with DSpark, in its place.
    Model Runner V2 drafts elsewhere (its own speculators), so it is refused."""
    base = type(runner)
    if not hasattr(base, "propose_draft_token_ids"):
        raise ValueError(
            f"DSpark drafts through Model Runner V1's propose_draft_token_ids, "
            f"which {base.__name__} does not have: run vLLM's V1 runner "
            f"(VLLM_USE_V2_MODEL_RUNNER=0)"
        )
    cls = _RUNNERS.get(base)
    if cls is None:
        cls = _RUNNERS[base] = type(f"DSpark{base.__name__}", (DSparkRunnerMixin, base), {})
    return cls(vllm_config, device)


class DSparkRunnerMixin:
    """Mixed in before a V1 model runner class."""

    def __init__(self, vllm_config, device: torch.device):
        super().__init__(vllm_config, device)
        if self.speculative_config.method == "dspark":
            self.drafter = DSparkProposer(vllm_config, device, self)
        self._step_started: float | None = None

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self._step_started = time.perf_counter()
        return super().execute_model(scheduler_output, intermediate_tensors)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        if not isinstance(self.drafter, DSparkProposer):
            return super().propose_draft_token_ids(
                scheduler_output, sampled_token_ids, *args, **kwargs
            )
        batch = self.input_batch
        num_reqs = batch.num_reqs
        if torch.is_tensor(sampled_token_ids):
            # `method="dspark"` drafts before bookkeeping, from the padded sampled ids
            # (-1: rejected), so this step's tokens are not yet counted in the batch.
            discarded = self.discard_request_mask.np[:num_reqs]
            sampled = [
                [] if discarded[i] else [t for t in row if t >= 0]
                for i, row in enumerate(sampled_token_ids[:num_reqs].tolist())
            ]
            counted = batch.num_tokens_no_spec[:num_reqs] + [len(s) for s in sampled]
        else:  # custom_class: after bookkeeping
            sampled, counted = sampled_token_ids, batch.num_tokens_no_spec[:num_reqs]
        seconds = None if self._step_started is None else time.perf_counter() - self._step_started
        return self.drafter.propose_step(
            scheduler_output, sampled, counted, batch.req_ids, seconds, self._draft_room(counted)
        )

    def _draft_room(self, counted) -> np.ndarray:
        """Per row, the drafts worth verifying: verifying k drafts yields at most k + 1
        tokens, so drafts past a request's max_tokens (or the model's length) would be
        computed and thrown away. `counted`: each row's tokens with this step's."""
        batch = self.input_batch
        num_reqs = batch.num_reqs
        limits = np.full(num_reqs, self.max_model_len, dtype=np.int64)
        for i, req_id in enumerate(batch.req_ids[:num_reqs]):
            params = self.requests[req_id].sampling_params
            if params is not None and params.max_tokens is not None:
                limits[i] = min(limits[i], batch.num_prompt_tokens[i] + params.max_tokens)
        return np.maximum(limits - np.asarray(counted, dtype=np.int64) - 1, 0)

    def _sample(self, logits, spec_decode_metadata, *args, **kwargs):
        """A step that verifies no drafts samples as a plain decode step. V1 sends every
        step of a speculative engine through its rejection sampler, drafts or none; with
        none it computes what the plain sampler does (the bonus token is sampled by the
        same sampler, no random draw is made for a request without drafts), at about
        16 ms a step for 64 requests on the CPU: the whole cost of a gate that skips."""
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            spec_decode_metadata = None
        return super()._sample(logits, spec_decode_metadata, *args, **kwargs)

    def sample_tokens(self, grammar_output):
        output = super().sample_tokens(grammar_output)
        if isinstance(self.drafter, DSparkProposer) and isinstance(output, ModelRunnerOutput):
            counters = self.drafter.take_counters()
            if counters:
                setattr(output, RUNNER_OUTPUT_ATTR, counters)
        return output


_RUNNERS: dict[type, type] = {}
"""vLLM's runner class -> its DSpark subclass (one class per base, so pickling and
isinstance checks see one type)."""
