"""vLLM's GPU worker with the plugin's features (worker_base.py), for the plugin's V4.1 on
NVIDIA/AMD GPUs: `--worker-cls vllm_deepinfer.worker.gpu_worker.DeepInferGPUWorker`.

Bounded replay, DSpark drafting and deterministic sampling hook Model Runner V1's
persistent batch and sampler; under Model Runner V2 (which upstream's own V4.1 uses) the
worker refuses to start with bounded replay on, naming the switch (replay_feed.py)."""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from vllm_deepinfer.worker.worker_base import DeepInferWorkerMixin


class DeepInferGPUWorker(DeepInferWorkerMixin, Worker):
    pass
