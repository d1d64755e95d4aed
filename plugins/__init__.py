"""vLLM entry points. `register()` only registers: it is called in every vLLM process
(API server, engine core, workers), possibly many times. `frontend()` is the endpoint
plugin factory, called once by the API server."""


def register() -> None:
    """`vllm.general_plugins` entry point `deepinfer`."""
    from vllm_deepinfer.model.registration import register_deepseek_v41
    from vllm_deepinfer.structured.registration import register_grammar_cache

    register_deepseek_v41()
    register_grammar_cache()


def frontend():
    """`vllm.endpoint_plugins` entry point `deepinfer`: the DeepSeek API routes."""
    from vllm_deepinfer.serving.frontend import DeepInferFrontend

    return DeepInferFrontend()
