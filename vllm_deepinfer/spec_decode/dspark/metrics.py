"""DSpark's counters on vLLM's Prometheus registry (`/metrics`, and `LLM.get_metrics()`
through patches/offline_metrics.py).

Per step, from the scheduler's `DSparkDecodingStats` (stats.py): drafts proposed, drafts
verified and accepted, both per position (accepted[i] / verified[i] is the conditional
acceptance at position i, given the drafts before it were accepted), and the confidence
head's calibration: over verified drafts with a known outcome, the sum of predicted
acceptance probabilities beside the number accepted (mean predicted vs observed).
"""
from __future__ import annotations

from prometheus_client import Counter
from vllm.v1.metrics.loggers import StatLoggerBase

PROPOSED = Counter("deepinfer:spec_decode_proposed_tokens",
                   "Draft tokens DSpark proposed, before variable-length verification.")
VERIFIED = Counter("deepinfer:spec_decode_verified_tokens",
                   "Draft tokens the target verified.")
ACCEPTED = Counter("deepinfer:spec_decode_accepted_tokens", "Draft tokens accepted.")
VERIFIED_PER_POS = Counter("deepinfer:spec_decode_verified_tokens_per_pos",
                           "Draft tokens verified, by position in the draft.", ["position"])
ACCEPTED_PER_POS = Counter("deepinfer:spec_decode_accepted_tokens_per_pos",
                           "Draft tokens accepted, by position in the draft.", ["position"])
CALIBRATED = Counter("deepinfer:spec_decode_calibrated_drafts",
                     "Verified draft tokens whose confidence and outcome are both known.")
CONFIDENCE_SUM = Counter("deepinfer:spec_decode_confidence_sum",
                         "Sum of the confidence head's acceptance probability over those "
                         "drafts (divided by calibrated_drafts: mean predicted acceptance).")
CALIBRATED_ACCEPTED = Counter("deepinfer:spec_decode_calibrated_accepted",
                              "How many of those drafts were accepted (divided by "
                              "calibrated_drafts: observed acceptance).")


class DSparkStatLogger(StatLoggerBase):
    """Counts (through plugins/stat_loggers.py); nothing without speculative decoding."""

    def __init__(self, vllm_config, engine_index: int = 0):
        pass

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
               engine_idx: int = 0) -> None:
        spec = None if scheduler_stats is None else scheduler_stats.spec_decoding_stats
        if spec is None:
            return
        VERIFIED.inc(spec.num_draft_tokens)
        ACCEPTED.inc(spec.num_accepted_tokens)
        for position, (verified, accepted) in enumerate(zip(spec.num_draft_tokens_per_pos,
                                                            spec.num_accepted_tokens_per_pos)):
            VERIFIED_PER_POS.labels(position=str(position)).inc(verified)
            ACCEPTED_PER_POS.labels(position=str(position)).inc(accepted)
        PROPOSED.inc(getattr(spec, "num_proposed_tokens", 0))
        CALIBRATED.inc(getattr(spec, "num_calibrated_drafts", 0))
        CONFIDENCE_SUM.inc(getattr(spec, "confidence_sum", 0.0))
        CALIBRATED_ACCEPTED.inc(getattr(spec, "num_calibrated_accepted", 0))

    def log_engine_initialized(self) -> None:
        pass
