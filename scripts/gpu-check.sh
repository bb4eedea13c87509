#!/bin/bash
# Issue 13's GPU check, for a session lent a GPU (the device tool runs it in the repository root):
#   bash scripts/gpu-check.sh [--dp-size N] [--dtype float32 bfloat16]
# The GPU image's python3 holds torch, transformers and tokenizers; bench.runs.gpu_check needs nothing
# else for its in-process steps (its server step is skipped without daphne). Everything it prints
# and its JSON land in $OUT (the device tool brings that folder back).
# The server step needs the project's own packages, which the image lacks: download them here as
# wheels for the image's Python (3.12 on the H200 image, 2026-12-04) into an ignored folder, carry
# it, and name it in GPU_CHECK_WHEELS (the folder, holding req.txt and the wheels):
#   grep -vE '^(#|torch|transformers|tokenizers|safetensors|numpy|sglang|vllm|selenium|ruff|openai|pytest|hypothesis)' \
#     requirements.txt | sed 's/ *#.*//' | grep -v '^$' > .devwheels/req.txt
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_28_x86_64 --platform any -d .devwheels -r .devwheels/req.txt
set -o pipefail
if [ -n "$GPU_CHECK_WHEELS" ]; then
    python3 -m pip install -q --no-index --find-links "$GPU_CHECK_WHEELS" -r "$GPU_CHECK_WHEELS/req.txt" 2>&1 |
        grep -v "Running pip as"
fi
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
timeout "${GPU_CHECK_TIMEOUT_S:-480}" "$PY" -m bench.runs.gpu_check --device cuda \
    --json "$OUT/gpu-check.json" --log "$OUT/engine.log" "$@" 2>&1 | tee "$OUT/gpu-check.log"
