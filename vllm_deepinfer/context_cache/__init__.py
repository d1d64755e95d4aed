"""Context caching on disk: the global KV (compressed latents and index keys) persisted
through vLLM's OffloadingConnector with its tiering spec, so a conversation resumed after
a restart, or on another instance sharing the directory, skips its prefill and replays
only the window (kv_cache/bounded_replay.py).

- `spec.py`: the offloading spec vLLM loads by `spec_module_path`; on the CPU it brings
  the worker vLLM lacks (`host_worker.py`), elsewhere vLLM's own worker runs.
- `disk_tier.py`: the persistent tier (one checked file per block, TTL, disk cap),
  `block_file.py` its file format, `layout.py` what a file's layout depends on.
- `config.py`: `--context-cache-dir` / DEEPINFER_CONTEXT_CACHE_DIR expanded to the
  connector configuration.
"""
