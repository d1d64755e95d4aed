"""The DSpark proposer on vLLM's V1 runner (the CPU's), for the plugin's V4.1.

The draft stages live in the target model (model/deepseek_v41/dspark.py), which writes
their context during its own step; after sampling, the proposer asks the gate
(draft_gate.py) whether drafting pays at this load, drafts one block per request from its
anchor (the token just sampled), asks `varlen` how many drafts each request's next step
verifies, and returns the lists (a shorter list verifies fewer tokens; empty lists when
the step does not draft). What it learns each step: the verdicts (calibration.py) and the
step's measured times (cost_model.py). Verification is vLLM's: its rejection sampler
compares the drafts with the target's greedy choice or samples losslessly (drafts are
treated as one-hot).

Reached two ways: vLLM's own `{"method": "dspark"}`, where the plugin's runner
(runner.py) puts this proposer in place of the EAGLE proposer V1 builds for it, and
`{"method": "custom_class", "model": "vllm_deepinfer.spec_decode.dspark.proposer.DSparkProposer"}`,
where vLLM builds it and calls `propose` with the sampled tokens.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_deepinfer import envs
from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.spec_decode.dspark.calibration import Recalibration
from vllm_deepinfer.spec_decode.dspark.cost_model import StepCostModel
from vllm_deepinfer.spec_decode.dspark.draft_gate import DraftGate
from vllm_deepinfer.spec_decode.dspark.stats import DraftCounters, DraftGauges
from vllm_deepinfer.spec_decode.dspark.varlen import verification_lengths

logger = init_logger(__name__)

GAUGE_EVERY = 64  # decode steps between the windowed figures' updates


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
        self.calibration = Recalibration(self.num_speculative_tokens)
        self.gate = DraftGate(self.num_speculative_tokens)
        self.counters = DraftCounters()
        # request -> its drafts' (raw, recalibrated) confidences, while being verified
        self.in_verification: dict[str, tuple[list[float], list[float]]] = {}
        self.steps_since_gauges = 0
        self.next_probe_row = 0  # where the next partial draft's requests start
        self.target = None
        logger.info(
            "DSpark drafts %d tokens per step; variable-length verification %s",
            self.num_speculative_tokens,
            "on" if self.varlen else "off (DEEPINFER_ENABLE_MTP_VARLEN=0)",
        )

    # --- hooks V1 calls on EAGLE-style drafters ------------------------------------
    def load_model(self, target_model) -> None:
        if getattr(getattr(target_model, "model", None), "draft", None) is None:
            raise ValueError(
                "the DSpark proposer drafts with vllm-deepinfer's V4.1 model, "
                "built with its DSpark stages; this target has none"
            )
        self.target = target_model

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        """The stages' windows are the target's paged caches: nothing to set up."""

    def initialize_cudagraph_keys(self, cudagraph_mode) -> None:
        """No CUDA graphs on this path."""

    def dummy_run(self, num_tokens: int, *args, is_graph_capturing: bool = False, **kwargs) -> None:
        """vLLM's warm-up: the draft stages run once on dummy blocks, which compiles them
        (profile runs bind no caches, so they read no context). Not while the runner
        captures the target's CUDA graphs: the draft runs outside them."""
        if self.target is not None and not is_graph_capturing:
            self.target.warm_up_draft(self.num_speculative_tokens)

    def take_last_draft_probs(self):
        return None  # greedy drafts: vLLM's rejection sampler treats them as one-hot

    # --- drafting ------------------------------------------------------------------
    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray | None = None,
        slot_mappings=None,
    ) -> list[list[int]]:
        """`method="custom_class"`'s call: drafts for every request that sampled a token
        this step (rows in the runner's batch order), none for partial prefills. No step
        times reach this path, so every draft is verified."""
        rows = self._drafting_rows(sampled_token_ids, None)
        drafts, _, _ = self._draft(sampled_token_ids, num_tokens_no_spec, rows, plan=False)
        return drafts

    def propose_step(
        self,
        scheduler_output,
        sampled_token_ids: list[list[int]],
        num_tokens: np.ndarray,
        req_ids: list[str],
        step_seconds: float | None,
        room: np.ndarray | None = None,
    ) -> list[list[int]]:
        """The plugin runner's call (num_tokens: each request's tokens with this step's;
        room: per row, the drafts worth verifying before the request's length limit):
        learns from the step (which drafts were verified and accepted, its time), asks
        the gate whether to draft, drafts and plans the next step's verification."""
        self._observe_verdicts(scheduler_output, sampled_token_ids, req_ids)
        num_scheduled = scheduler_output.num_scheduled_tokens
        scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        # Tokens of requests that did not decode (prefill chunks) this step.
        other_tokens = sum(
            n for r, n in num_scheduled.items() if n != 1 + len(scheduled_drafts.get(r, ()))
        )
        requests = sum(1 for sampled in sampled_token_ids if sampled)
        rows = self._drafting_rows(sampled_token_ids, room)
        candidates = len(rows)
        # Timing steers the gate in variable-length mode only.
        seconds = step_seconds if self.varlen else None
        timed = seconds is not None
        drafting = (
            self.gate.decide(self.cost.fit(), candidates, len(num_scheduled))
            if timed
            else candidates
        )
        started = time.perf_counter()
        drafts, raw, calibrated = self._draft(
            sampled_token_ids, num_tokens, rows, other_tokens, plan=timed, limit=drafting, room=room
        )
        for row, req_id in enumerate(req_ids):
            if raw[row]:
                self.in_verification[req_id] = (raw[row], calibrated[row])
        draft_seconds = time.perf_counter() - started
        if requests:
            self.counters.request_steps += requests
            self.steps_since_gauges += 1
        if candidates:
            self.counters.decode_steps += 1
            self.counters.skipped_steps += not drafting
        if seconds is not None and requests:
            if not other_tokens:
                self.cost.record(
                    scheduler_output.total_num_scheduled_tokens,
                    len(num_scheduled),
                    seconds,
                    drafting,
                    draft_seconds,
                )
            self.gate.record(
                drafting > 0, sum(len(s) for s in sampled_token_ids), seconds + draft_seconds
            )
        return drafts

    def _observe_verdicts(self, scheduler_output, sampled_token_ids, req_ids) -> None:
        """What this step's verification says about the drafts it verified."""
        scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        for row, req_id in enumerate(req_ids):
            confidences = self.in_verification.pop(req_id, None)
            verified = len(scheduled_drafts.get(req_id, ()))
            if confidences is None or verified == 0 or not sampled_token_ids[row]:
                continue
            raw, calibrated = confidences
            verified = min(verified, len(raw))
            accepted = min(len(sampled_token_ids[row]) - 1, verified)
            self.counters.calibrated += verified
            self.counters.confidence_sum += float(sum(raw[:verified]))
            self.counters.accepted += accepted
            self.calibration.observe(raw[:verified], calibrated[:verified], accepted)
        self.in_verification.clear()  # drafts of requests not in this step are dropped

    def _draft(
        self,
        sampled_token_ids,
        num_tokens,
        rows: list[int],
        other_tokens: int = 0,
        plan: bool = True,
        limit: int | None = None,
        room: np.ndarray | None = None,
    ) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
        """Per request row: its draft (empty for rows not in `rows`, those that could
        draft, and for rows past `limit` drafting requests, taken in turn), cut to
        the verification plan's length (`plan`, in variable-length mode) and the row's
        room, and the drafts' raw and recalibrated confidences. The anchor is the last
        token sampled, at position num_tokens - 1."""
        if limit is not None and limit < len(rows):
            start = self.next_probe_row % len(rows)
            self.next_probe_row += limit
            rows = sorted((rows + rows)[start : start + limit])
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        raw: list[list[float]] = [[] for _ in sampled_token_ids]
        calibrated: list[list[float]] = [[] for _ in sampled_token_ids]
        if not rows or self.target is None:
            return drafts, raw, calibrated
        positions = np.asarray(num_tokens)[rows] - 1
        anchors = [sampled_token_ids[i][-1] for i in rows]
        tokens, confidence = self.target.draft(
            torch.as_tensor(anchors, dtype=torch.int64),
            torch.as_tensor(positions),
            torch.as_tensor(rows),
            self.num_speculative_tokens,
        )
        recalibrated = self.calibration(confidence)
        self.gate.observe(recalibrated)
        size = self.num_speculative_tokens
        caps = [size if room is None else min(size, int(room[row])) for row in rows]
        # Drafts past a request's room are proposed to no one: the plan sees them as
        # never accepted.
        within = torch.arange(size) < torch.tensor(caps)[:, None]
        lengths = (
            verification_lengths(recalibrated * within, self.cost.fit(), other_tokens)
            if plan
            else caps
        )
        self.counters.proposed += sum(caps)
        tokens, confidence, recalibrated = (
            tokens.tolist(),
            confidence.tolist(),
            recalibrated.tolist(),
        )
        for j, row in enumerate(rows):
            drafts[row] = tokens[j][: min(lengths[j], caps[j])]
            raw[row], calibrated[row] = confidence[j], recalibrated[j]
        return drafts, raw, calibrated

    @staticmethod
    def _drafting_rows(sampled_token_ids, room: np.ndarray | None) -> list[int]:
        """Rows that could draft: they sampled a token, and a draft of theirs could
        still be accepted before the request's length limit."""
        return [
            i
            for i, sampled in enumerate(sampled_token_ids)
            if sampled and (room is None or room[i] > 0)
        ]

    def gauges(self) -> DraftGauges:
        """The windowed figures: calibration error, per-position agreement, cost fit."""
        ece = self.calibration.ece()
        per_position = self.calibration.per_position()
        quality = self.cost.quality
        return DraftGauges(
            ece_raw=None if ece is None else ece[0],
            ece_calibrated=None if ece is None else ece[1],
            predicted_per_pos=[p for n, p, _ in per_position if n],
            observed_per_pos=[y for n, _, y in per_position if n],
            cost_fit_r2=None if quality is None else quality.r2,
            cost_fit_error=None if quality is None else quality.mean_relative_error,
        )

    def take_counters(self) -> DraftCounters:
        if self.steps_since_gauges >= GAUGE_EVERY:
            self.steps_since_gauges = 0
            self.counters.gauges = self.gauges()
        counters, self.counters = self.counters, DraftCounters()
        return counters
