"""vLLM's CPU worker, telling the V4.1 model where each request's replay starts.

vLLM's scheduler decides replay starts (kv_cache/bounded_replay.py) but its V1 runner
passes them to no model; this worker hands every step's scheduler output to the replay
tracker before the runner builds the step. With DSpark speculative decoding it runs the
plugin's runner (spec_decode/dspark/runner.py); with deterministic sampling, the runner's
seeded draws are keyed by position (determinism/sampling.py); with `--enable-eplb`, the
runner gets vLLM's EPLB state (eplb/runner.py). Selected through vLLM's `worker_cls` (the CPU
platform patch sets it for the plugin's V4.1 when the user left it `auto`).
"""
from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_deepinfer import envs
from vllm_deepinfer.determinism import sampling as determinism
from vllm_deepinfer.eplb import metrics as moe_balance
from vllm_deepinfer.eplb.runner import attach_eplb
from vllm_deepinfer.kv_cache.bounded_replay import tracker_for


class DeepInferCPUWorker(CPUWorker):
    def init_device(self):
        super().init_device()
        from vllm_deepinfer.model.deepseek_v41.registration import uses_dspark_stages

        if uses_dspark_stages(self.vllm_config):
            # The runner is the last thing vLLM's init_device builds: replaced here by
            # the one that drafts with the plugin's DSpark proposer.
            from vllm_deepinfer.spec_decode.dspark.runner import DSparkCPUModelRunner

            self.model_runner = DSparkCPUModelRunner(self.vllm_config, self.device)
        if envs.load().deterministic_sampling:
            determinism.install(self.model_runner)

    def load_model(self):
        super().load_model()
        if self.vllm_config.parallel_config.enable_eplb:
            attach_eplb(self.model_runner)  # vLLM's CPU runner leaves EPLB out

    def sample_tokens(self, grammar_output):
        output = super().sample_tokens(grammar_output)
        return moe_balance.attach(output, self.model_runner.__dict__.pop(
            moe_balance.RUNNER_OUTPUT_ATTR, None))

    def execute_model(self, scheduler_output):
        tracker = tracker_for(self.vllm_config)
        tracker.begin_step(scheduler_output, self.model_runner)
        try:
            return super().execute_model(scheduler_output)
        finally:
            tracker.end_step()

    def deepinfer_replay_stats(self) -> dict:
        """Rows this worker replayed and trimmed so far, and its recent admissions'
        replay starts (`LLM.collective_rpc`)."""
        return tracker_for(self.vllm_config).stats()
