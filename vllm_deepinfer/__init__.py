"""vllm-deepinfer: DeepSeek V4.1-Flash and DeepInfer's serving features for stock vLLM."""
