#!/bin/bash
# The device checks of the GPU issue, as one short script for a lent GPU machine (about 15 minutes in all).
# Prints what ran on: card, driver, CUDA and torch; then the CUDA tests; exit status: pytest's.
set -u
cd "$(dirname "$0")/../.."
python - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
PY
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
timeout 480 python -m pytest -q -p no:cacheprovider tests/gpu -rs
