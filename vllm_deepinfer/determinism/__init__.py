"""Determinism: batch-invariant inference (`batch_invariant.py`, the CPU ops that make
vLLM's own VLLM_BATCH_INVARIANT work on the CPU in `cpu_ops.py`) and deterministic
sampling (`sampling.py`: random draws keyed by a request's seed and the position of the
token drawn)."""
