"""vLLM entry points. Each `register()` only registers: it is called in every vLLM
process (API server, engine core, workers), possibly many times."""


def register() -> None:
    """`vllm.general_plugins` entry point `deepinfer`."""
    from vllm_deepinfer.model.registration import register_deepseek_v41

    register_deepseek_v41()
