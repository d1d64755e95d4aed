"""DSpark's counters and gauges on vLLM's Prometheus registry (`/metrics`, and
`LLM.get_metrics()` through patches/offline_metrics.py).

From vLLM's speculative-decoding stats: drafts verified and accepted, both per position
(accepted[i] / verified[i] is the conditional acceptance at position i, given the drafts
before it were accepted). From the proposer's counts (stats.py): drafts proposed, decode
steps and those that ran no draft, the confidence head's calibration (over verified
drafts with a known outcome, the sum of its own predicted acceptance probabilities beside
the number accepted), and, over the proposer's recent window, the expected calibration
error of the raw and recalibrated probabilities, mean predicted vs observed acceptance
per position, and the cost model's fit quality.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge
from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_deepinfer.spec_decode.dspark.stats import STATS_FIELD

PROPOSED = Counter(
    "deepinfer:spec_decode_proposed_tokens",
    "Draft tokens DSpark proposed (within each request's room before its length limit), "
    "before variable-length verification.",
)
VERIFIED = Counter("deepinfer:spec_decode_verified_tokens", "Draft tokens the target verified.")
ACCEPTED = Counter("deepinfer:spec_decode_accepted_tokens", "Draft tokens accepted.")
VERIFIED_PER_POS = Counter(
    "deepinfer:spec_decode_verified_tokens_per_pos",
    "Draft tokens verified, by position in the draft.",
    ["position"],
)
ACCEPTED_PER_POS = Counter(
    "deepinfer:spec_decode_accepted_tokens_per_pos",
    "Draft tokens accepted, by position in the draft.",
    ["position"],
)
CALIBRATED = Counter(
    "deepinfer:spec_decode_calibrated_drafts",
    "Verified draft tokens whose confidence and outcome are both known.",
)
CONFIDENCE_SUM = Counter(
    "deepinfer:spec_decode_confidence_sum",
    "Sum of the confidence head's acceptance probability over those "
    "drafts (divided by calibrated_drafts: mean predicted acceptance).",
)
CALIBRATED_ACCEPTED = Counter(
    "deepinfer:spec_decode_calibrated_accepted",
    "How many of those drafts were accepted (divided by calibrated_drafts: observed acceptance).",
)
DECODE_STEPS = Counter(
    "deepinfer:spec_decode_decode_steps",
    "Steps in which at least one request could draft (it sampled a token and has tokens "
    "left to generate past the next).",
)
SKIPPED_STEPS = Counter(
    "deepinfer:spec_decode_skipped_draft_steps",
    "Decode steps that ran no draft: the plan found that drafting would not pay at this load.",
)
REQUEST_STEPS = Counter(
    "deepinfer:spec_decode_request_steps", "Requests that sampled a token, summed over steps."
)
ECE = Gauge(
    "deepinfer:spec_decode_ece",
    "Expected calibration error of draft acceptance "
    "probabilities over the proposer's recent verdicts: the confidence head's own "
    "(raw) and recalibrated ones the plan used (calibrated).",
    ["confidence"],
    multiprocess_mode="mostrecent",
)
PREDICTED_PER_POS = Gauge(
    "deepinfer:spec_decode_predicted_acceptance",
    "Mean recalibrated acceptance probability of recent verified drafts, by position.",
    ["position"],
    multiprocess_mode="mostrecent",
)
OBSERVED_PER_POS = Gauge(
    "deepinfer:spec_decode_observed_acceptance",
    "Observed acceptance of the same drafts, by position.",
    ["position"],
    multiprocess_mode="mostrecent",
)
COST_FIT = Gauge(
    "deepinfer:spec_decode_cost_fit",
    "How well the cost model's predicted "
    "decode-step times (target step plus draft) match the measured ones over "
    "its window: r2, and mean_relative_error.",
    ["figure"],
    multiprocess_mode="mostrecent",
)


class DSparkStatLogger(StatLoggerBase):
    """Counts (through plugins/stat_loggers.py); nothing without speculative decoding."""

    def __init__(self, vllm_config, engine_index: int = 0):
        pass

    def record(
        self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0
    ) -> None:
        if scheduler_stats is None:
            return
        spec = scheduler_stats.spec_decoding_stats
        if spec is not None:
            VERIFIED.inc(spec.num_draft_tokens)
            ACCEPTED.inc(spec.num_accepted_tokens)
            for position, (verified, accepted) in enumerate(
                zip(spec.num_draft_tokens_per_pos, spec.num_accepted_tokens_per_pos)
            ):
                VERIFIED_PER_POS.labels(position=str(position)).inc(verified)
                ACCEPTED_PER_POS.labels(position=str(position)).inc(accepted)
        counts = getattr(scheduler_stats, STATS_FIELD, None)
        if counts is None:
            return
        PROPOSED.inc(counts.proposed)
        CALIBRATED.inc(counts.calibrated)
        CONFIDENCE_SUM.inc(counts.confidence_sum)
        CALIBRATED_ACCEPTED.inc(counts.accepted)
        DECODE_STEPS.inc(counts.decode_steps)
        SKIPPED_STEPS.inc(counts.skipped_steps)
        REQUEST_STEPS.inc(counts.request_steps)
        gauges = counts.gauges
        if gauges is None:
            return
        for name, value in (("raw", gauges.ece_raw), ("calibrated", gauges.ece_calibrated)):
            if value is not None:
                ECE.labels(confidence=name).set(value)
        for position, (predicted, observed) in enumerate(
            zip(gauges.predicted_per_pos, gauges.observed_per_pos)
        ):
            PREDICTED_PER_POS.labels(position=str(position)).set(predicted)
            OBSERVED_PER_POS.labels(position=str(position)).set(observed)
        for name, value in (
            ("r2", gauges.cost_fit_r2),
            ("mean_relative_error", gauges.cost_fit_error),
        ):
            if value is not None:
                COST_FIT.labels(figure=name).set(value)

    def log_engine_initialized(self) -> None:
        pass
