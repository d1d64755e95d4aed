"""SWA bounded replay through vLLM's own KV cache manager and scheduler.

A window cache declared as `ReplayWindowSpec` is not prefix-cached (only global KV is),
and says how many tokens of a hit are recomputed: vLLM's scheduler then drops hits no
longer than that, rewinds longer ones to `replay_start = hit - keep` and allocates fresh
window blocks from there (`prefix_cacheable` / `prefix_replay_tokens`). What vLLM's V1
runner does not do is tell the model where each request's replay starts; a `ReplayTracker`
per engine does, fed by the plugin's workers (worker/replay_feed.py) and read by the cache
metadata builder (kv_cache/paged.py), which also keeps replayed rows from writing shared
cached blocks.

A replayed admission computes the compressed KV of the blocks after its hit from windows
truncated at its replay start: approximate, and cached like any other, so a later hit on
those blocks reads it and replays on top of it (a chain of replays, which
ReferenceV41.logits specifies). Exact mode (keep 0) keeps every cache and replays nothing;
deterministic sampling brings it (envs.py), so that a seeded request computes the same on
a hit as on a miss.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, replace

import torch
from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class ReplayWindowSpec(SlidingWindowMLASpec):
    """A window cache rebuilt by replay instead of prefix-cached.

    The last `replay_tokens` of a hit are recomputed into it, so its blocks from the replay
    start on must be fresh: `extra_retained_tokens` is raised to cover them (vLLM rewrites
    that field on every sliding-window spec, and its merge forgets subclass fields; both
    are undone here). `lookback_tokens`: how many token ids before the replay start the
    cache's reader needs (Engram's n-grams)."""

    replay_tokens: int = 0
    lookback_tokens: int = 0

    def __post_init__(self):
        super().__post_init__()
        needed = max(self.extra_retained_tokens, self.replay_tokens - self.sliding_window + 1)
        object.__setattr__(self, "extra_retained_tokens", needed)

    @property
    def prefix_cacheable(self) -> bool:
        return False

    @property
    def prefix_replay_tokens(self) -> int:
        return self.replay_tokens

    @classmethod
    def merge(cls, specs):
        assert all(isinstance(s, ReplayWindowSpec) for s in specs), (
            "a KV cache group holds replayed windows only"
        )
        own = {(s.replay_tokens, s.lookback_tokens) for s in specs}
        assert len(own) == 1, "layers of one KV cache group must replay alike"
        replay_tokens, lookback_tokens = own.pop()
        return replace(
            super().merge(specs), replay_tokens=replay_tokens, lookback_tokens=lookback_tokens
        )

    def is_uniform_with_collection(self, kv_cache_specs) -> bool:
        return super().is_uniform_with_collection(kv_cache_specs) and all(
            isinstance(s, ReplayWindowSpec) and s.replay_tokens == self.replay_tokens
            for s in kv_cache_specs.values()
        )


def register_replay_specs() -> None:
    """Declares ReplayWindowSpec to vLLM's registry (managed like any sliding window). The
    built-in specs are registered first: the registry skips them once it is non-empty."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(
        ReplayWindowSpec, SlidingWindowManager, uniform_type_base_spec=SlidingWindowMLASpec
    )


@dataclass
class RequestReplay:
    """Where a request's recomputation starts, in token positions.

    `start`: the replay start s (0 without a replayed hit); positions in [s, s + keep)
    rebuild window caches only. `kept_from`: decoder-side replay, the first prompt row
    the last kv source and later layers compute (max(s, prompt_len - keep)), or `start`
    when the request needs every row (prompt logprobs)."""

    start: int
    kept_from: int
    prompt_len: int
    every_row: bool


@dataclass
class StepReplay:
    """One step's replay layout, per request in the runner's batch order."""

    start: torch.Tensor  # [R] int64
    kept_from: torch.Tensor  # [R] int64


ADMISSIONS_KEPT = 4096
"""Recent admissions a tracker remembers, for checks: (request, replay start, kept_from,
tokens the request had when admitted)."""


class ReplayTracker:
    """Per engine: every running request's replay start and decoder-replay row, counters
    of rows replayed and rows trimmed by decoder-side replay, and recent admissions."""

    def __init__(self):
        self.keep = 0
        self.decoder_replay = False
        self.requests: dict[str, RequestReplay] = {}
        self.runner = None
        self.step = 0
        self._view: tuple[int, int, StepReplay] | None = None
        self.replayed_rows = 0
        self.trimmed_rows = 0
        self.replayed_requests = 0
        self.admissions: deque[tuple[str, int, int, int]] = deque(maxlen=ADMISSIONS_KEPT)

    def configure(self, keep: int, decoder_replay: bool) -> None:
        self.keep, self.decoder_replay = keep, decoder_replay

    def begin_step(self, scheduler_output, runner) -> None:
        """Records this step's admissions (new, and resumed after preemption), forgets
        finished requests, and counts the rows this step replays and trims."""
        self.runner = runner
        self.step += 1
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        if not self.keep:
            return
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            every_row = params is None or params.prompt_logprobs is not None
            # vLLM sends the replay start of new requests; where it does not, and for
            # resumed ones, it is where the admission resumes (no KV connector runs).
            start = getattr(new, "replay_start", new.num_computed_tokens)
            self._admit(new.req_id, start, new.prompt_len, every_row, new.prompt_len)
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i]
            if req_id in cached.resumed_req_ids and req_id in self.requests:
                old = self.requests[req_id]
                self._admit(
                    req_id,
                    cached.num_computed_tokens[i],
                    old.prompt_len,
                    old.every_row,
                    old.prompt_len + cached.num_output_tokens[i],
                )
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            if state is None or req_id not in computed:
                continue
            first, last = computed[req_id], computed[req_id] + n
            if state.start:
                self.replayed_rows += max(0, min(last, state.start + self.keep) - first)
            self.trimmed_rows += max(0, min(last, state.kept_from) - max(first, state.start))

    def _admit(
        self, req_id: str, start: int, prompt_len: int, every_row: bool, num_tokens: int
    ) -> None:
        kept_from = start
        if self.decoder_replay and not every_row:
            kept_from = max(start, prompt_len - self.keep)
        self.requests[req_id] = RequestReplay(start, kept_from, prompt_len, every_row)
        self.replayed_requests += start > 0
        self.admissions.append((req_id, start, kept_from, num_tokens))

    def end_step(self) -> None:
        self.runner = None

    def view(self, num_reqs: int) -> StepReplay | None:
        """This step's per-request layout, or None outside a scheduled step (profile and
        warm-up runs) or in exact mode."""
        if not self.keep or self.runner is None:
            return None
        if self._view is not None and self._view[:2] == (self.step, num_reqs):
            return self._view[2]
        states = [self.requests.get(r) for r in self._batch().req_ids[:num_reqs]]
        view = StepReplay(
            torch.tensor([s.start if s else 0 for s in states], dtype=torch.int64),
            torch.tensor([s.kept_from if s else 0 for s in states], dtype=torch.int64),
        )
        self._view = (self.step, num_reqs, view)
        return view

    def _batch(self):
        """The runner's persistent batch: its request order is the step's, and it holds
        every request's token ids. Runner internals, so checked."""
        batch = getattr(self.runner, "input_batch", None)
        if not (hasattr(batch, "req_ids") and hasattr(batch, "token_ids_cpu")):
            raise RuntimeError(
                "bounded replay reads vLLM's model runner's input_batch.req_ids and "
                "token_ids_cpu, which this vLLM no longer has; run in exact mode "
                "(DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=0)"
            )
        return batch

    def tokens_before(self, view: StepReplay, depth: int) -> torch.Tensor:
        """[R, depth] token ids at positions start-depth .. start-1 of each request (-1
        before position 0 and for requests that replay nothing)."""
        ids = torch.full((len(view.start), depth), -1, dtype=torch.int64)
        tokens = self._batch().token_ids_cpu
        for row, start in enumerate(view.start.tolist()):
            if start:
                first = max(0, start - depth)
                ids[row, depth - (start - first) :] = torch.from_numpy(
                    tokens[row, first:start].astype("int64")
                )
        return ids

    def stats(self) -> dict:
        return {
            "replayed_rows": self.replayed_rows,
            "trimmed_rows": self.trimmed_rows,
            "replayed_requests": self.replayed_requests,
            "admissions": list(self.admissions),
        }


_TRACKERS: dict[int, ReplayTracker] = {}


def tracker_for(vllm_config) -> ReplayTracker:
    """The tracker of the engine that `vllm_config` configures: its model, worker and
    cache metadata builders all hold that one config object (several engines may share
    a process, as in-process offline engines do)."""
    key = id(vllm_config)
    if key not in _TRACKERS:
        _TRACKERS[key] = ReplayTracker()
        weakref.finalize(vllm_config, _TRACKERS.pop, key, None)
    return _TRACKERS[key]


@dataclass(frozen=True)
class ReplaySettings:
    keep: int
    """Tokens of a hit replayed, and prompt rows decoder-side replay keeps; 0: exact mode."""
    cut: int | None
    """Decoder-side replay: the last kv source, from which layers run on kept rows only
    (None: off)."""


def replay_settings(vllm_config, a) -> ReplaySettings:
    """DEEPINFER_YOCO_PREFILL_KEEP_TOKENS checked against the model and vLLM's settings:
    its window, vLLM's --no-swa-bounded-replay (exact mode), a hybrid KV cache manager
    (vLLM's disabled one would turn every window cache into a full cache) and a worker
    that tells the model where replays start."""
    from vllm_deepinfer import envs, vllm_support

    keep = envs.load().yoco_prefill_keep_tokens
    if not keep:
        return ReplaySettings(0, None)
    if keep < a.sliding_window:
        raise envs.ConfigError(
            f"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS={keep} is smaller than the model's sliding "
            f"window ({a.sliding_window}); use at least {a.sliding_window}, or 0 for exact mode"
        )
    if not vllm_support.has_model_runner_v1():  # the plugin's worker feeds that runner
        vllm_support.model_runner_v1_feature_off("bounded_replay")  # once per process
        return ReplaySettings(0, None)
    off = None
    if not getattr(vllm_config.cache_config, "swa_bounded_replay", True):
        off = "--no-swa-bounded-replay is set"
    elif vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        off = "the hybrid KV cache manager is disabled"
    elif not _replay_worker(vllm_config.parallel_config.worker_cls):
        off = (
            f"the worker ({vllm_config.parallel_config.worker_cls}) does not pass replay "
            f"starts to the model; use the plugin's worker for the device "
            f"(--worker-cls vllm_deepinfer.worker.cpu_worker.DeepInferCPUWorker or "
            f"vllm_deepinfer.worker.gpu_worker.DeepInferGPUWorker)"
        )
    if off:
        logger.warning("Bounded and decoder-side replay are off (exact mode): %s", off)
        return ReplaySettings(0, None)
    return ReplaySettings(keep, a.decoder_replay_cut)


def _replay_worker(worker_cls) -> bool:
    """Whether `worker_cls` (a class or its qualified name) feeds replay starts: the
    plugin's workers declare it (`feeds_replay_starts`)."""
    try:
        from vllm.utils.import_utils import resolve_obj_by_qualname

        cls = resolve_obj_by_qualname(worker_cls) if isinstance(worker_cls, str) else worker_cls
        return bool(getattr(cls, "feeds_replay_starts", False))
    except Exception:  # noqa: BLE001 - an unresolvable worker simply does not replay
        return False
