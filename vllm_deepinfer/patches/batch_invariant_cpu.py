"""vLLM's own VLLM_BATCH_INVARIANT=1 on the CPU.

Why: `init_batch_invariance` (run by every worker) calls `enable_batch_invariant_mode`,
which registers Triton kernels for mm/addmm/bmm/softmax/log_softmax/mean at the platform's
dispatch key, "CPU" on the CPU platform; Triton has no CPU backend, so the first sample
crashes the engine core, for every model. And the CPU's linear layers do not go through
those ops at all: `dispatch_cpu_unquantized_gemm` gives each layer a packed oneDNN (or
sgl) kernel, `layer.cpu_linear`, whose results for a row change with the number of rows.

How: on the CPU platform, `enable_batch_invariant_mode` registers the plugin's torch
kernels (determinism/cpu_ops.py) instead of upstream's, and `dispatch_cpu_unquantized_gemm`
wraps the kernel it chose so that it always runs on fixed tiles of rows
(determinism/batch_invariant.py) while batch invariance is on. Other platforms keep
upstream's functions.

Upstream symbols: vllm.model_executor.determinism.batch_invariant.enable_batch_invariant_mode
and vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm. Remove when vLLM
registers CPU kernels of its own for batch invariance and keeps CPU linears invariant.
"""

from __future__ import annotations

import functools

from vllm_deepinfer.patches.base import PatchUnavailable, installed, source_of

UPSTREAM = (
    "vllm.model_executor.determinism.batch_invariant.enable_batch_invariant_mode, "
    "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"
)
_MARK = "_deepinfer_batch_invariant_cpu"


def check_upstream():
    try:
        from vllm.model_executor.determinism import batch_invariant as upstream
        from vllm.model_executor.layers import utils
    except ImportError as exc:
        raise PatchUnavailable(f"vLLM's batch-invariance module moved ({exc})") from exc
    for owner, name in (
        (upstream, "enable_batch_invariant_mode"),
        (upstream, "init_batch_invariance"),
        (utils, "dispatch_cpu_unquantized_gemm"),
    ):
        if not callable(getattr(owner, name, None)):
            raise PatchUnavailable(f"{owner.__name__}.{name} is missing")
    if "enable_batch_invariant_mode()" not in source_of(
        upstream.init_batch_invariance, "init_batch_invariance"
    ):
        raise PatchUnavailable("init_batch_invariance no longer calls enable_batch_invariant_mode")
    if "cpu_linear" not in source_of(
        utils.dispatch_cpu_unquantized_gemm, "dispatch_cpu_unquantized_gemm"
    ):
        raise PatchUnavailable("dispatch_cpu_unquantized_gemm no longer sets cpu_linear")
    return upstream, utils


def apply() -> bool:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    upstream, utils = check_upstream()
    if installed(upstream.enable_batch_invariant_mode, _MARK):
        return True
    from vllm_deepinfer.determinism import batch_invariant, cpu_ops

    @functools.wraps(upstream.enable_batch_invariant_mode)
    def enable_batch_invariant_mode():
        cpu_ops.register()

    @functools.wraps(utils.dispatch_cpu_unquantized_gemm)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        dispatch(layer, remove_weight)
        kernel = layer.cpu_linear
        if batch_invariant.enabled() and not getattr(kernel, _MARK, False):

            def row_tiled_linear(x, weight, bias=None):
                """The layer's kernel on fixed tiles of x's rows."""
                return batch_invariant.row_tiled(lambda tile: kernel(tile, weight, bias), x)

            setattr(row_tiled_linear, _MARK, True)
            layer.cpu_linear = row_tiled_linear

    dispatch = utils.dispatch_cpu_unquantized_gemm
    setattr(enable_batch_invariant_mode, _MARK, True)
    upstream.enable_batch_invariant_mode = enable_batch_invariant_mode
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    return True
