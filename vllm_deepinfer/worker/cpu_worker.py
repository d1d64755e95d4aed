"""vLLM's CPU worker with the plugin's features (worker_base.py). The CPU platform patch
selects it for the plugin's V4.1 when the user left `worker_cls` at `auto`
(patches/cpu_platform_config.py)."""

from __future__ import annotations

import os
import time

from vllm.config import CompilationMode
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_deepinfer import envs
from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.model.deepseek_v41.compilation import compiled_unless_batch_invariant
from vllm_deepinfer.worker.worker_base import DeepInferWorkerMixin

logger = init_logger(__name__)


class DeepInferCPUWorker(DeepInferWorkerMixin, CPUWorker):
    def determine_available_memory(self) -> int:
        """vLLM's CPU worker compiles the model here (its warm-up), and logs where it saved
        the result but neither how long compiling took nor that the next start loads it."""
        from vllm.compilation.counter import compilation_counter

        compiles, saved = (
            compilation_counter.num_aot_compiles,
            compilation_counter.num_aot_artifacts_saved,
        )
        start = time.perf_counter()
        if self.vllm_config.compilation_config.mode != CompilationMode.NONE and (
            compiled_unless_batch_invariant(self.vllm_config)
        ):
            check_vector_isas()
        available = super().determine_available_memory()
        if compilation_counter.num_aot_compiles > compiles and self.rank == 0:
            logger.info(
                "%s compiled in %.1f s (with its warm-up run); %s",
                self.vllm_config.model_config.architecture,
                time.perf_counter() - start,
                "vLLM's compile cache keeps it: the next start with the same model and "
                "settings loads it instead of compiling"
                if compilation_counter.num_aot_artifacts_saved > saved
                else "it was not saved to vLLM's compile cache: the next start compiles again",
            )
        return available


def check_vector_isas() -> None:
    """Runs Inductor's check of which vector ISAs the C++ compiler builds for (a test
    program built and loaded per ISA the CPU has: about 11 s on a 2-core machine) with its
    builds kept under vLLM's cache root, before vLLM compiles the model.

    Inductor remembers the result for the process but builds the test programs in its
    cache dir, which vLLM points at a new directory for every model configuration: each
    first compile of a configuration (every setting, checkpoint or feature that changes
    the graph) built them all again. Checked here first, the next process finds them
    built and only loads them."""
    import vllm.envs
    from torch._inductor import cpu_vec_isa

    builds = os.path.join(vllm.envs.VLLM_CACHE_ROOT, "deepinfer", "inductor_isa")
    with envs.overridden(TORCHINDUCTOR_CACHE_DIR=builds):
        cpu_vec_isa.valid_vec_isa_list()
