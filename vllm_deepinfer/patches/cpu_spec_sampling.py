"""Sampling constraints in speculative verification on the CPU.

Why: vLLM's rejection sampler applies temperature, top-k and top-p to the verified
positions through `apply_sampling_constraints`, which spreads each request's value over
its draft positions with `expand_batch_to_tokens`. That runs the Triton `expand_kernel`,
which the CPU platform serves with `cpu_triton_utils._expand_kernel_impl`: it hands the C++
kernel `output.to(torch.int64)`, a copy unless the output is already int64, so for
temperature and top-p (float32) and top-k (int32) the kernel writes into a temporary and
the expanded tensor keeps whatever `new_empty` held. Verification then samples with
garbage temperatures and limits. And when no request of a step has drafts (variable-length
verification chose none, or a request's drafts were all dropped), there are no verified
positions at all, and `apply_top_k_only` takes `k.max()` of an empty tensor: one request
with `top_k` kills the engine core (every later request gets EngineDeadError), on any
platform.

How: on the CPU, `vllm.v1.sample.rejection_sampler.expand_batch_to_tokens` is replaced by
a torch expansion (`repeat_interleave` of the per-request counts, the same replacement of
`replace_from`, the input's dtype kept); on every platform `apply_sampling_constraints`
returns its (empty) input when there are no verified positions. `RejectionSampler.forward`
and `apply_sampling_constraints` look both names up in their module, so the module
attributes are what is replaced; the upstream code runs unchanged otherwise.

Upstream symbols: vllm.v1.sample.rejection_sampler.expand_batch_to_tokens (CPU) and
vllm.v1.sample.rejection_sampler.apply_sampling_constraints; written against vLLM 0.32.

Remove when: the CPU expand kernel writes into outputs of any dtype (the CPU half then
reports `not needed`) and `apply_top_k_only` accepts zero rows.
"""

from __future__ import annotations

import functools

from vllm_deepinfer.determinism.expand import expand_batch_to_tokens
from vllm_deepinfer.patches.base import PatchUnavailable, installed, parameter_names, source_of

UPSTREAM = (
    "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens, "
    "vllm.v1.sample.rejection_sampler.apply_sampling_constraints"
)
_MARK = "_deepinfer_cpu_spec_sampling"
_EXPAND_PARAMETERS = ["x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"]


def _cpu_expand_drops_outputs() -> bool:
    """Whether the CPU platform's expand kernel converts its output to int64 (writing into
    a copy for any other dtype), read from vLLM's source."""
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return False
    kernel = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    if kernel is None:
        return False
    return "_ensure_int64(output)" in source_of(kernel, "cpu_triton_utils._expand_kernel_impl")


def _check_upstream(module) -> tuple:
    expand = getattr(module, "expand_batch_to_tokens", None)
    constraints = getattr(module, "apply_sampling_constraints", None)
    if expand is None or constraints is None:
        raise PatchUnavailable(
            "vllm.v1.sample.rejection_sampler no longer defines "
            "expand_batch_to_tokens and apply_sampling_constraints"
        )
    if parameter_names(expand) != _EXPAND_PARAMETERS:
        raise PatchUnavailable(
            "rejection_sampler.expand_batch_to_tokens now takes "
            f"({', '.join(parameter_names(expand))})"
        )
    source = source_of(constraints, "rejection_sampler.apply_sampling_constraints")
    if "expand_batch_to_tokens(" not in source:
        raise PatchUnavailable(
            "rejection_sampler.apply_sampling_constraints no longer "
            "expands per-request values with expand_batch_to_tokens"
        )
    forward = source_of(module.RejectionSampler.forward, "RejectionSampler.forward")
    if "apply_sampling_constraints(" not in forward:
        raise PatchUnavailable(
            "RejectionSampler.forward no longer calls apply_sampling_constraints"
        )
    return expand, constraints


def _wrap_constraints(original):
    @functools.wraps(original)
    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        if logits.shape[0] == 0:
            return logits
        return original(logits, cu_num_draft_tokens, sampling_metadata)

    setattr(apply_sampling_constraints, _MARK, True)
    return apply_sampling_constraints


def apply(on_cpu: bool) -> bool:
    """Idempotent; raises PatchUnavailable when vLLM no longer matches."""
    try:
        from vllm.v1.sample import rejection_sampler
    except ImportError as exc:
        raise PatchUnavailable(
            f"vllm.v1.sample.rejection_sampler cannot be imported ({exc})"
        ) from exc
    expand, constraints = _check_upstream(rejection_sampler)
    if not installed(constraints, _MARK):
        rejection_sampler.apply_sampling_constraints = _wrap_constraints(constraints)
    if on_cpu and expand is not expand_batch_to_tokens and _cpu_expand_drops_outputs():
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return True
