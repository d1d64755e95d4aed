"""Triton kernels for the GPU fast paths. Each kernel has a plain-torch twin in the model
package (``indexer_scores`` -> ``model/deepseek_v41/indexer.py: index_scores``;
``fixed_tile_matmul`` -> ``determinism/batch_invariant.py: linear``) with the same math,
and is tested against it (tests/kernels/: on the CPU through
Triton's interpreter, on a GPU compiled). Kernel modules are imported lazily, only where
the tensors live on a GPU; nothing is imported at package import time, so importing this
package never needs Triton or a GPU."""
