"""When vLLM compiles V4.1's graphs (the target's layers and DSpark's draft stages), and
under which compile tag each is cached."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from vllm.config import CompilationMode, VllmConfig

from vllm_deepinfer.determinism import batch_invariant
from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)


def compiled_unless_batch_invariant(vllm_config: VllmConfig) -> bool:
    """vLLM compiles V4.1 unless batch-invariant mode is on: Inductor's fused loops put
    their SIMD tails where the batch's size puts them, which breaks invariance
    (determinism/batch_invariant.py), so that mode runs the model eager."""
    if not batch_invariant.enabled():
        return True
    if vllm_config.compilation_config.mode != CompilationMode.NONE:
        logger.info_once(
            "Batch-invariant mode: V4.1 runs eager (compiled kernels would "
            "tie results to the batch's size)"
        )
    return False


def compile_tag(tag: str) -> AbstractContextManager:
    """A second compiled module of one model (the draft stages beside the target) gets its
    own tag, which vLLM's compile cache and logs use to tell them apart (as it does for
    EAGLE's head); a vLLM without tags has one cache key per module's code anyway."""
    try:
        from vllm.compilation.backends import set_model_tag
    except ImportError:
        return nullcontext()
    return set_model_tag(tag)
