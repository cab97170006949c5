#!/usr/bin/env bash
# GPU check (see bench/gpu_check.py): a short real DAPO run on CUDA vLLM + an FSDP2/NCCL learner,
# weight-sync correctness, tokens/s and sync time. Needs the GPU image or `pip install -e .[gpu]`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec timeout 480 "$PY" bench/gpu_check.py "$@"
