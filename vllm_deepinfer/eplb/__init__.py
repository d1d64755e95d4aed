"""Expert-parallel load balancing: the load-balance metric (`moe_lb`), the plugin's EPLB
policy, and a trace-driven simulator that runs vLLM's policies at production scale."""
