#!/usr/bin/env bash
# Set up .venv for this project (idempotent; quiet when already done).
#   CPU machines: installs the pinned CPU wheel torch==2.13.0 first, so nothing pulls a multi-GB CUDA build.
#   GPU machines (nvidia-smi present) or PMZ_TORCH="<pip spec>": installs that torch instead
#   (default on GPU: the registry's CUDA build), plus flash-attn when PMZ_FLASH_ATTN=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
pip_q() { "$VPY" -m pip install --disable-pip-version-check -q "$@" 2>&1 | grep -v -E "^WARNING: (Location|Ignoring)" || true; }
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  if [ -n "${PMZ_TORCH:-}" ]; then
    pip_q "$PMZ_TORCH"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    pip_q torch
  else
    pip_q "torch==2.13.0"
  fi
fi
if ! "$VPY" -c "import models, parallel, converters, transformers, safetensors, pytest, hypothesis" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.pmz-installed ]; then
  pip_q -e ".[dev]"
  touch .venv/.pmz-installed
fi
if [ "${PMZ_FLASH_ATTN:-0}" = "1" ]; then
  pip_q flash-attn --no-build-isolation
fi
"$VPY" -c "import torch, models, parallel, converters" || { echo "setup failed: the project does not import" >&2; exit 1; }
