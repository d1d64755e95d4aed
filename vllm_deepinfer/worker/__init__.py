"""What composes the plugin's features for a device, as vLLM's `v1/worker/` does for its own.

`cpu_worker.py` and `gpu_worker.py` are thin subclasses of vLLM's CPU and GPU workers
sharing one composition (`worker_base.py`); each feature the composition attaches is a
module of its own: `replay_feed.py` (tells the model where bounded replays start),
`dspark_runner.py` (the runner that drafts with DSpark), `eplb.py` (vLLM's EPLB state and
`moe_lb` on a runner that leaves them out) and `sampling.py` (deterministic sampling's
position-keyed draws). Nothing below this package imports it.
"""
