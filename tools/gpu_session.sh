#!/usr/bin/env bash
# One lent-GPU session in ONE device call of at most ~9 minutes (docs/benchmarks.md, "GPU session").
#
#   run(command="bash tools/gpu_session.sh", carry=["wheels"], timeout_s=560)
#
# 1. installs the wheels carried in the gitignored wheels/ folder, if any (no network there:
#    pip install --no-index --no-deps --target .gpu-site; e.g. transformers 5.24, megatron-core 0.19.2;
#    fetch them here with `pip download --no-deps -d wheels transformers==5.24.0 megatron-core==0.19.2`);
# 2. runs every CUDA test file (tests/test_gpu*.py), at most GPU_TEST_SECONDS (300 s);
# 3. runs tools/bench_gpu.py in phases, most wanted first, each only while time is left
#    (GPU_SESSION_SECONDS, default 520: the whole script's budget; GPU_TEST_SECONDS, default 300).
# Logs go to $OUT (the device machine's return folder), else out/gpu_session/.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_session}
mkdir -p "$OUT"
BUDGET=${GPU_SESSION_SECONDS:-520}   # leave the call's last ~40 s for copying $OUT back
START=$(date +%s)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1   # a stage cut by its timeout keeps every line it printed
left() { echo $((BUDGET - ($(date +%s) - START))); }
log() { echo "[$(($(date +%s) - START))s] $*" | tee -a "$OUT/session.log"; }

if compgen -G "wheels/*.whl" > /dev/null; then
  log "installing $(ls wheels/*.whl | wc -l) carried wheels into .gpu-site"
  $PY -m pip install --no-index --no-deps --target .gpu-site wheels/*.whl > "$OUT/pip.log" 2>&1 \
    || log "pip install failed (see pip.log)"
  export PYTHONPATH="$PWD/.gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
$PY - > "$OUT/env.txt" 2>&1 <<'EOF'
import importlib, importlib.util, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
for name in ("transformers", "megatron.core", "triton", "liger_kernel", "flash_attn_2_cuda", "flash_attn_interface",
             "flash_attn.cute"):
    try:
        found = importlib.util.find_spec(name) is not None
    except ImportError:
        found = False
    try:
        version = getattr(importlib.import_module(name), "__version__", "") if found and "." not in name else ""
    except Exception as e:  # installed but does not import here: say why, go on
        version = f"(import fails: {type(e).__name__}: {e})"
    print(name, "installed" if found else "absent", version)
from parallel.varlen_kernels import flash_kernel, installed_kernels
q = torch.zeros(1, 1, 128, device="cuda", dtype=torch.bfloat16)
print("usable attention kernels:", sorted(installed_kernels(q.device)))
print("chosen: equal lengths", flash_kernel(q, equal_lengths=True), "| unequal", flash_kernel(q),
      "| with lse", flash_kernel(q, need_lse=True))
from parallel import fused_ops
x = torch.zeros(2, 64, device="cuda", dtype=torch.bfloat16)
print("fused ops: rms_norm", fused_ops.rms_norm_backend(x, x[0]), "| swiglu", fused_ops.swiglu_backend(x))
EOF
log "env: $(tr '\n' ';' < "$OUT/env.txt")"

# Every tests/test_gpu*.py (test_gpu.py, test_gpu_fused_ops.py, test_gpu_head.py, test_gpu_moe.py,
# test_gpu_models.py, ...), the kernel files first, the slower model comparisons last. One pytest process
# (one CUDA start); -rfEs lists failures, errors and skips (e.g. liger-kernel missing) in the summary,
# --durations shows where the time went; the log is written as it runs, so a timeout keeps what ran.
# First H200 run (2026-11-28): fused_ops ~2 min (Triton compiles per shape/dtype), head+moe+gpu+models
# 70 s, gdn > 40 s for its first test alone (fla's autotuned kernels compile): gdn goes last.
mapfile -t GPU_TESTS < <(ls tests/test_gpu*.py | grep -v -e '^tests/test_gpu_models.py$' -e '^tests/test_gpu_gdn.py$')
for last in tests/test_gpu_models.py tests/test_gpu_gdn.py; do [ -f "$last" ] && GPU_TESTS+=("$last"); done
log "tests: ${GPU_TESTS[*]}"
timeout "${GPU_TEST_SECONDS:-300}" $PY -m pytest -v --tb=short -rfEs --durations=15 -p no:cacheprovider "${GPU_TESTS[@]}" \
  > "$OUT/pytest.log" 2>&1
log "pytest exit $? : $(tail -1 "$OUT/pytest.log")"

# (label, arguments) - most wanted first; each runs only with >= 75 s left and is cut at the budget.
PHASES=(
  "qwen2 4x1024 + profile|--setup qwen2-1.5b --shape 4x1024 --variants ours,hf,hf-liger,megatron --profile"
  "where ours' step time goes (tools/gpu_probe.py: syncs, host ops, fused-path A/B)|PROBE"
  "qwen3-moe 4x1024|--setup qwen3-moe --shape 4x1024 --variants ours,hf,hf-liger"
  "Gated DeltaNet layer, ours vs transformers with fla|GDN"
  "rl-logprob 4x1024|--setup rl-logprob --shape 4x1024 --variants ours,hf"
  "ours with torch's FA2 (PMZ_ATTENTION_KERNEL=torch)|--setup qwen2-1.5b --shape 4x1024 --variants ours|torch"
  "qwen3-8b-cut 4x1024|--setup qwen3-8b-cut --shape 4x1024 --variants ours,hf,megatron"
  "qwen2 8x2048|--setup qwen2-1.5b --shape 8x2048 --variants ours,hf,megatron"
  "qwen2 4x1024 compiled|--setup qwen2-1.5b --shape 4x1024 --variants ours-compiled"
  "qwen3-moe 8x2048|--setup qwen3-moe --shape 8x2048 --variants ours,hf"
)
for phase in "${PHASES[@]}"; do
  IFS='|' read -r label argv kernel <<< "$phase"
  remaining=$(left)
  if [ "$remaining" -lt 75 ]; then log "skipped (time): $label"; continue; fi
  log "bench: $label"
  if [ "$argv" = PROBE ]; then
    timeout "$(( remaining < 150 ? remaining : 150 ))" $PY tools/gpu_probe.py --variants ours,hf >> "$OUT/bench.log" 2>&1
    log "  exit $?"
    continue
  fi
  if [ "$argv" = GDN ]; then  # one layer (tools/bench_gdn.py; carry fla-core + einops wheels for fla)
    timeout "$(( remaining < 120 ? remaining : 120 ))" $PY tools/bench_gdn.py --device cuda --hf-kernel auto \
      > "$OUT/bench_gdn.log" 2>&1
    log "  exit $?"
    continue
  fi
  # shellcheck disable=SC2086
  PMZ_ATTENTION_KERNEL=${kernel:-} timeout "$remaining" $PY tools/bench_gpu.py $argv --steps 5 --warmup 2 \
    --timeout "$remaining" >> "$OUT/bench.log" 2>&1
  log "  exit $?"
done
log "done"
