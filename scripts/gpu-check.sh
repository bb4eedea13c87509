#!/bin/bash
# Issue 13's GPU check, for a session lent a GPU (the device tool runs it in the repository root):
#   bash scripts/gpu-check.sh [--dp-size N] [--dtype float32 bfloat16]
# The GPU image's python3 holds torch, transformers and tokenizers; bench.runs.gpu_check needs nothing
# else for its in-process steps (its server step is skipped without daphne). Everything it prints
# and its JSON land in $OUT (the device tool brings that folder back).
set -o pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
timeout "${GPU_CHECK_TIMEOUT_S:-480}" "$PY" -m bench.runs.gpu_check --device cuda \
    --json "$OUT/gpu-check.json" --log "$OUT/engine.log" "$@" 2>&1 | tee "$OUT/gpu-check.log"
