"""Small, version-guarded changes to vLLM where it offers no hook. Each module states the
vLLM versions it was written against and refuses to apply elsewhere."""
