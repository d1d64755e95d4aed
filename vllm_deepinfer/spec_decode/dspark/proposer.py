"""The DSpark proposer on vLLM's V1 runner (the CPU's), for the plugin's V4.1.

The draft stages live in the target model (model/deepseek_v41/dspark.py), which writes
their context during its own step; after sampling, the proposer drafts one block per
request from its anchor (the token just sampled), asks `varlen` how many drafts each
request's next step verifies, and returns the lists (a shorter list verifies fewer
tokens). Verification is vLLM's: its rejection sampler compares the drafts with the
target's greedy choice or samples losslessly (drafts are treated as one-hot).

Reached two ways: vLLM's own `{"method": "dspark"}`, where the plugin's runner
(runner.py) puts this proposer in place of the EAGLE proposer V1 builds for it, and
`{"method": "custom_class", "model": "vllm_deepinfer.spec_decode.dspark.proposer.DSparkProposer"}`,
where vLLM builds it and calls `propose` with the sampled tokens.
"""
from __future__ import annotations

import numpy as np
import torch
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_deepinfer import envs
from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.spec_decode.dspark.stats import DraftCounters
from vllm_deepinfer.spec_decode.dspark.varlen import (Recalibration, StepCostModel,
                                                      verification_lengths)

logger = init_logger(__name__)


class DSparkProposer(EagleProposer):
    """A subclass of EagleProposer only so that V1's checks on `method="dspark"` drafters
    pass: EagleProposer's state (a separate draft model, its buffers, attention backend
    and CUDA graphs) has nothing to hold here, so its constructor is not run and the
    hooks V1 calls on it are answered by this class."""

    def __init__(self, vllm_config, device: torch.device | None = None, runner=None):
        self.vllm_config = vllm_config
        self.speculative_config = vllm_config.speculative_config
        self.num_speculative_tokens = self.speculative_config.num_speculative_tokens
        self.kv_cache_gid = 0  # the runner reads it; no draft attention group of its own
        self.draft_attn_groups: list = []
        self.supports_mm_inputs = False
        self.varlen = envs.load().enable_mtp_varlen
        self.cost = StepCostModel()
        self.calibration = Recalibration()
        self.counters = DraftCounters()
        self.in_verification: dict[str, list[float]] = {}  # request -> drafts' confidences
        self.target = None
        logger.info("DSpark drafts %d tokens per step; variable-length verification %s",
                    self.num_speculative_tokens,
                    "on" if self.varlen else "off (DEEPINFER_ENABLE_MTP_VARLEN=0)")

    # --- hooks V1 calls on EAGLE-style drafters ------------------------------------
    def load_model(self, target_model) -> None:
        if getattr(getattr(target_model, "model", None), "draft", None) is None:
            raise ValueError("the DSpark proposer drafts with vllm-deepinfer's V4.1 model, "
                             "built with its DSpark stages; this target has none")
        self.target = target_model

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        """The stages' windows are the target's paged caches: nothing to set up."""

    def initialize_cudagraph_keys(self, cudagraph_mode) -> None:
        """No CUDA graphs on this path."""

    def dummy_run(self, num_tokens: int, *args, **kwargs) -> None:
        """Profile runs bind no caches, so there is no draft to run."""

    def take_last_draft_probs(self):
        return None  # greedy drafts: vLLM's rejection sampler treats them as one-hot

    # --- drafting ------------------------------------------------------------------
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray | None = None, slot_mappings=None) -> list[list[int]]:
        """`method="custom_class"`'s call: drafts for every request that sampled a token
        this step (rows in the runner's batch order), none for partial prefills."""
        drafts, _ = self._draft(sampled_token_ids, num_tokens_no_spec)
        return drafts

    def propose_step(self, scheduler_output, sampled_token_ids: list[list[int]],
                     num_tokens: np.ndarray, req_ids: list[str],
                     step_seconds: float | None) -> list[list[int]]:
        """The plugin runner's call: `propose` (num_tokens: each request's tokens with
        this step's), plus what the counters and the cost model learn from the step
        (which drafts were verified and accepted, its time)."""
        scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        for row, req_id in enumerate(req_ids):
            confidences = self.in_verification.pop(req_id, None)
            verified = len(scheduled_drafts.get(req_id, ()))
            if confidences is None or verified == 0 or not sampled_token_ids[row]:
                continue
            verified = min(verified, len(confidences))
            accepted = min(len(sampled_token_ids[row]) - 1, verified)
            self.counters.calibrated += verified
            self.counters.confidence_sum += float(sum(confidences[:verified]))
            self.counters.accepted += accepted
            self.calibration.observe(confidences[:verified], accepted)
        self.calibration.refit()
        self.in_verification.clear()  # drafts of requests not in this step are dropped
        num_scheduled = scheduler_output.num_scheduled_tokens
        # Tokens of requests that did not decode (prefill chunks) this step.
        other_tokens = sum(n for r, n in num_scheduled.items()
                           if n != 1 + len(scheduled_drafts.get(r, ())))
        if step_seconds is not None and num_scheduled and not other_tokens:
            self.cost.record(scheduler_output.total_num_scheduled_tokens, len(num_scheduled),
                             step_seconds)
        drafts, confidences = self._draft(sampled_token_ids, num_tokens, other_tokens)
        for row, req_id in enumerate(req_ids):
            if drafts[row]:
                self.in_verification[req_id] = confidences[row][: len(drafts[row])]
        return drafts

    def _draft(self, sampled_token_ids, num_tokens,
               other_tokens: int = 0) -> tuple[list[list[int]], list[list[float]]]:
        """Per request row: its draft (empty without a sampled token: a partial prefill)
        and the drafts' confidences. The anchor is the last token sampled, at position
        num_tokens - 1."""
        rows = [i for i, sampled in enumerate(sampled_token_ids) if sampled]
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        confidences: list[list[float]] = [[] for _ in sampled_token_ids]
        if not rows or self.target is None:
            return drafts, confidences
        positions = np.asarray(num_tokens)[rows] - 1
        anchors = [sampled_token_ids[i][-1] for i in rows]
        tokens, confidence = self.target.draft(
            torch.as_tensor(anchors, dtype=torch.int64), torch.as_tensor(positions),
            torch.as_tensor(rows), self.num_speculative_tokens)
        lengths = (verification_lengths(self.calibration(confidence), self.cost.fit(),
                                        other_tokens)
                   if self.varlen else [self.num_speculative_tokens] * len(rows))
        self.counters.proposed += tokens.numel()
        tokens, confidence = tokens.tolist(), confidence.tolist()
        for j, row in enumerate(rows):
            drafts[row] = tokens[j][: lengths[j]]
            confidences[row] = confidence[j]
        return drafts, confidences

    def take_counters(self) -> DraftCounters:
        counters, self.counters = self.counters, DraftCounters()
        return counters
