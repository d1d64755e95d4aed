"""Triton kernels for the GPU fast paths. Each kernel has a plain-torch reference in
``vllm_deepinfer.model.ops`` with the same signature and math, and is tested against it
(tests/test_kernels.py, which runs them on the CPU through Triton's interpreter). Kernel
modules are imported lazily, only where the tensors live on a GPU; nothing is imported at
package import time, so importing this package never needs Triton or a GPU."""
