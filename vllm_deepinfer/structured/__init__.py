"""Structured outputs in DeepInfer's form (`so_args`) on vLLM's xgrammar backend."""
