"""The plugin's features composed over one of vLLM's V1 workers (CPU or GPU).

vLLM's scheduler decides where bounded replays start but its V1 runner tells no model;
vLLM's CPU runner leaves EPLB out; DSpark drafts from the plugin's runner; deterministic
sampling keys the runner's seeded draws by position. Each is a module of this package,
attached here at the point of vLLM's worker life cycle it needs.
"""

from __future__ import annotations

from vllm_deepinfer import envs
from vllm_deepinfer.model.deepseek_v41.registration import is_v41, uses_dspark_stages
from vllm_deepinfer.worker import dspark_runner, eplb, replay_feed, sampling


class DeepInferWorkerMixin:
    """Mixed in before a vLLM worker class (`class W(DeepInferWorkerMixin, Worker)`)."""

    feeds_replay_starts = True
    """Read by kv_cache.bounded_replay: a worker of this class feeds replay starts."""

    def init_device(self):
        super().init_device()
        if uses_dspark_stages(self.vllm_config):
            # The runner is the last thing vLLM's init_device builds: rebuilt here as the
            # same runner class drafting with the plugin's DSpark proposer.
            self.model_runner = dspark_runner.build(
                self.model_runner, self.vllm_config, self.device
            )
        if is_v41(self.vllm_config.model_config):
            replay_feed.check_runner(self.model_runner)
        if envs.load().deterministic_sampling:
            sampling.install(self.model_runner)

    def load_model(self, **kwargs):
        if is_v41(self.vllm_config.model_config):
            from vllm_deepinfer.patches import require_for_v41

            require_for_v41()  # stops here, naming the patch, where vLLM moved under one
        super().load_model(**kwargs)
        if self.vllm_config.parallel_config.enable_eplb:
            eplb.attach(self.model_runner)

    def sample_tokens(self, grammar_output):
        return eplb.attach_step_balance(super().sample_tokens(grammar_output), self.model_runner)

    def execute_model(self, scheduler_output):
        with replay_feed.step(self.vllm_config, scheduler_output, self.model_runner):
            return super().execute_model(scheduler_output)

    def deepinfer_replay_stats(self) -> dict:
        """Rows this worker replayed and trimmed so far, and its recent admissions'
        replay starts (`LLM.collective_rpc`)."""
        return replay_feed.stats(self.vllm_config)
