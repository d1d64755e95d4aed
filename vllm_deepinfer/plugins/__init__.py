"""vLLM entry points. `register()` only registers: it is called in every vLLM process
(API server, engine core, workers), for every model, possibly many times. `frontend()` is
the endpoint plugin factory, called once by the API server."""


def register() -> None:
    """`vllm.general_plugins` entry point `deepinfer`. Patches go through
    `vllm_deepinfer.patches.apply_patch`: one that cannot apply on this vLLM logs a warning
    and turns its feature off, and never makes this raise. On a vLLM without Model Runner
    V1 (0.34) each feature built on it is off, one line each (vllm_support.py)."""
    from vllm.platforms import current_platform

    from vllm_deepinfer import envs, patches, vllm_support
    from vllm_deepinfer.determinism.batch_invariant import follow_deepinfer_switch
    from vllm_deepinfer.kv_cache.bounded_replay import register_replay_specs
    from vllm_deepinfer.model.deepseek_v41.registration import is_v41, register_deepseek_v41
    from vllm_deepinfer.preload import preload_for_children
    from vllm_deepinfer.serving.grammar_cache import register_grammar_cache

    vllm_support.check_installed_vllm()  # one line where vLLM is outside the tested range
    if register_deepseek_v41() == "deepinfer":
        register_replay_specs()
        if not vllm_support.has_model_runner_v1():  # the plugin's worker hooks that runner
            vllm_support.model_runner_v1_feature_off("bounded_replay")
            vllm_support.model_runner_v1_feature_off("deterministic_sampling")
        patches.apply_patch("dspark_v1", serves_model=is_v41)
        patches.apply_patch("dspark_stats")
        patches.apply_patch("vision_language_arch")
        patches.apply_patch("vision_language_prompts")
    if register_deepseek_v41() == "deepinfer" and current_platform.is_cpu():
        patches.apply_patch("cpu_platform_config", serves_model=is_v41)
        patches.apply_patch("cpu_compiled_v41", serves_model=is_v41)
        patches.apply_patch("cpu_async_scheduling", serves_model=is_v41)
        patches.apply_patch("cpu_eplb", serves_model=is_v41)
    follow_deepinfer_switch(current_platform.is_cpu())
    envs.carry_to_ray_actors()
    if current_platform.is_cpu():
        preload_for_children()
        patches.apply_patch("batch_invariant_cpu")
        patches.apply_patch("cpu_compile_cache")
        patches.apply_patch("cpu_variable_collectives")
        patches.apply_patch("cpu_ray")  # the Ray backends
    patches.apply_patch("seeded_sampling")
    patches.apply_patch("cpu_spec_sampling", on_cpu=current_platform.is_cpu())
    patches.apply_patch("offline_metrics")
    patches.apply_patch("request_validators")
    patches.apply_patch("deepseek_v41_messages")
    # The processes' first: the window counts the workers' exit grace it sets.
    for shutdown_part in (
        "shutdown_processes",
        "shutdown_window",
        "shutdown_requests",
        "shutdown_at_exit",
        "orphaned_processes",
    ):
        patches.apply_patch(shutdown_part)
    patches.apply_patch("eplb_policy_choice")
    patches.apply_patch("eplb_stats")
    register_grammar_cache()


def frontend():
    """`vllm.endpoint_plugins` entry point `deepinfer`: the DeepSeek API routes."""
    from vllm_deepinfer.serving.frontend import DeepInferFrontend

    return DeepInferFrontend()
