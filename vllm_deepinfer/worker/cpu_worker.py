"""vLLM's CPU worker with the plugin's features (worker_base.py). The CPU platform patch
selects it for the plugin's V4.1 when the user left `worker_cls` at `auto`
(patches/cpu_platform_config.py)."""
from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_deepinfer.worker.worker_base import DeepInferWorkerMixin


class DeepInferCPUWorker(DeepInferWorkerMixin, CPUWorker):
    pass
