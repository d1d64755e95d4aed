"""vLLM's CPU worker with the plugin's features (worker_base.py). The CPU platform patch
selects it for the plugin's V4.1 when the user left `worker_cls` at `auto`
(patches/cpu_platform_config.py)."""

from __future__ import annotations

import time

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_deepinfer.logger import init_logger
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
