#!/usr/bin/env bash
# The GPU checks on a machine with CUDA and vLLM's CUDA build installed beside this
# package (pip install -e '.[test]'): the kernel, the batched step's parts and the paged
# model's fidelity on the GPU. About two minutes on one GPU; exits non-zero on a failure
# and when no GPU is visible (the tests would only be skipped).
set -euo pipefail
cd "$(dirname "$0")/../.."
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible")'
exec timeout 600 python -m pytest tests/gpu -m gpu -v --timeout=600 "$@"
