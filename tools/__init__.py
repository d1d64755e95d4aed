"""Developer tools, never installed: the engine's KV-cache plan on the meta device
(`kv_plan.py`, `make test-next-vllm`), the structured-outputs conformance suite
(`schema_conformance.py`, `make schema-conformance`) and the EPLB simulator
(`eplb_simulator.py`, `benchmarks/eplb.py`)."""
