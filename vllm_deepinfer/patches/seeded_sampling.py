"""Seeded sampling with chunked prefill on the CPU.

Why: vLLM's V1 runner samples a token for every scheduled request, also for one whose
prefill is only partly done; that token is thrown away. So that a seeded request draws
the same random numbers whether or not its prefill was chunked, the runner then winds
the request's generator back by one sample: `gen.set_offset(gen.get_offset() - 4)` in
`GPUModelRunner._bookkeeping_sync` (4 is the Philox offset one CUDA sample advances).
CPU generators (Mersenne Twister) have no offset, `get_offset()` raises "CPU Generator
does not use offset", and the engine core dies, for every model on the CPU, as soon as a
seeded request's prefill is chunked. Dropping the rewind is not enough: the CPU sampler
(`TopKTopPSampler.forward_cpu`) does draw from the generator of the discarded row (one
`torch.randint` per seeded row and step), so the tokens would depend on the chunking.

How: CPU generators can save and restore their whole state. `GPUModelRunner._sample` is
wrapped to save, just before sampling, the state of the CPU generators of the rows the
runner will discard (its `discard_request_mask`, set when the inputs were prepared);
`GPUModelRunner._bookkeeping_sync` is wrapped so that upstream's rewind loop finds, for
those rows, a stand-in whose `get_offset`/`set_offset` put the saved state back. The
upstream code runs unchanged, and its rewind lands exactly on the pre-sample state
(whatever the sampler drew). CUDA generators and rows that are kept are not touched.
`CPUModelRunner` inherits both methods; the V2 CPU runner does not use them.

Upstream symbols: vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync (the
rewind) and GPUModelRunner._sample (where the state is saved); written against vLLM 0.32.

Remove when: CPU generators support offsets (`apply()` then returns False and installs
nothing), or the runner stops rewinding with get_offset/set_offset (`apply()` then
raises PatchUnavailable: check whether seeded chunked prefill still works on the CPU).
"""

from __future__ import annotations

import functools

import torch

from vllm_deepinfer.patches.base import PatchUnavailable, source_of

UPSTREAM = (
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync, "
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample"
)

_MARK = "_deepinfer_seeded_sampling"
# Runner attribute: {batch row: (generator, state before this step's sample)}.
_SAVED = "_deepinfer_pre_sample_generator_states"


class _RewindableCPUGenerator:
    """What upstream's rewind loop gets for a CPU generator that drew for a discarded row.

    Offsets are positions of this stand-in only: `get_offset()` is the position after
    the step's sample, and setting any earlier position restores the state saved just
    before the sample. Other attributes are the generator's."""

    _AFTER_SAMPLE = 1 << 32

    def __init__(self, generator: torch.Generator, pre_sample_state: torch.Tensor):
        self._generator = generator
        self._pre_sample_state = pre_sample_state
        self._offset = self._AFTER_SAMPLE

    def get_offset(self) -> int:
        return self._offset

    def set_offset(self, offset: int) -> None:
        if offset > self._offset:
            raise RuntimeError("a CPU generator cannot be moved past its current state")
        if offset < self._offset:
            self._generator.set_state(self._pre_sample_state)
            self._offset = offset

    def __getattr__(self, name):
        return getattr(self._generator, name)


def _cpu_generators_have_offsets() -> bool:
    generator = torch.Generator(device="cpu")
    try:
        generator.set_offset(generator.get_offset())
    except RuntimeError:
        return False
    return True


def _check_cpu_generators_restore_state() -> None:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(1)
    try:
        state = generator.get_state()
        first = torch.randint(0, 2**31, (4,), generator=generator)
        generator.set_state(state)
        again = torch.randint(0, 2**31, (4,), generator=generator)
    except (RuntimeError, AttributeError) as e:
        raise PatchUnavailable(f"CPU generators cannot save/restore their state: {e}") from e
    if not torch.equal(first, again):
        raise PatchUnavailable("restoring a CPU generator's state does not repeat its draws")


def _source(runner_cls, name: str) -> str:
    function = getattr(runner_cls, name, None)
    if not callable(function):
        raise PatchUnavailable(f"vllm.v1.worker.gpu_model_runner.GPUModelRunner.{name} is missing")
    return source_of(function, f"GPUModelRunner.{name}")


def _check_upstream(runner_cls) -> None:
    """The behaviour the wrappers rely on, read from vLLM's source."""
    bookkeeping = _source(runner_cls, "_bookkeeping_sync")
    for needed, meaning in (
        ("set_offset(", "rewinds generators with set_offset"),
        ("get_offset()", "reads the generator offset"),
        ("input_batch.generators", "takes generators from input_batch"),
        ("discard_request_mask", "rewinds the discarded rows"),
    ):
        if needed not in bookkeeping:
            raise PatchUnavailable(
                f"GPUModelRunner._bookkeeping_sync no longer {meaning} "
                f"(no {needed!r} in its source)"
            )
    _source(runner_cls, "_sample")
    sample_tokens = _source(runner_cls, "sample_tokens")
    sample_at = sample_tokens.find("self._sample(")
    bookkeeping_at = sample_tokens.find("self._bookkeeping_sync(")
    if sample_at < 0 or bookkeeping_at < 0 or sample_at > bookkeeping_at:
        raise PatchUnavailable(
            "GPUModelRunner.sample_tokens no longer calls _sample and then _bookkeeping_sync"
        )


def _save_discarded_generator_states(runner) -> None:
    batch = runner.input_batch
    saved = {}
    if batch.generators:
        discarded = runner.discard_request_mask.np[: batch.num_reqs].nonzero()[0]
        for row in discarded.tolist():
            generator = batch.generators.get(row)
            if generator is not None and generator.device.type == "cpu":
                saved[row] = (generator, generator.get_state())
    setattr(runner, _SAVED, saved)


def _wrap_sample(original):
    @functools.wraps(original)
    def _sample(self, *args, **kwargs):
        _save_discarded_generator_states(self)
        return original(self, *args, **kwargs)

    setattr(_sample, _MARK, True)
    return _sample


def _wrap_bookkeeping_sync(original):
    @functools.wraps(original)
    def _bookkeeping_sync(self, *args, **kwargs):
        saved = getattr(self, _SAVED, None)
        setattr(self, _SAVED, None)
        if not saved:
            return original(self, *args, **kwargs)
        batch = self.input_batch
        generators = batch.generators
        shown = dict(generators)
        for row, (generator, state) in saved.items():
            if generators.get(row) is generator:
                shown[row] = _RewindableCPUGenerator(generator, state)
        batch.generators = shown
        try:
            return original(self, *args, **kwargs)
        finally:
            batch.generators = generators

    setattr(_bookkeeping_sync, _MARK, True)
    return _bookkeeping_sync


def apply() -> bool:
    """Idempotent. True when the wrappers are installed, False when CPU generators have
    offsets (nothing to do); raises PatchUnavailable when vLLM no longer matches."""
    try:
        from vllm.v1.worker import gpu_model_runner
    except ImportError as e:
        raise PatchUnavailable(f"vllm.v1.worker.gpu_model_runner cannot be imported: {e}") from e
    runner_cls = getattr(gpu_model_runner, "GPUModelRunner", None)
    if runner_cls is None:
        raise PatchUnavailable("vllm.v1.worker.gpu_model_runner.GPUModelRunner is missing")
    wrappers = {"_sample": _wrap_sample, "_bookkeeping_sync": _wrap_bookkeeping_sync}
    pending = [
        name for name in wrappers if not getattr(getattr(runner_cls, name, None), _MARK, False)
    ]
    if not pending:
        return True
    if _cpu_generators_have_offsets():
        return False
    _check_cpu_generators_restore_state()
    _check_upstream(runner_cls)
    for name in pending:
        setattr(runner_cls, name, wrappers[name](getattr(runner_cls, name)))
    return True
