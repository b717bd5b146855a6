"""The GPU kernels on a CPU: every Triton kernel of ours (SwiGLU, rotary) and every Liger-Kernel op the
models call (RMSNorm, RMSNorm fused with the residual add) run in Triton's interpreter
(``TRITON_INTERPRET=1``) against the torch reference, fp32 and bf16, forward and backward
(tests/triton_interpreter_cases.py runs them in one subprocess and reports one line per tensor).

Bounds, with ``M = max |exact|`` (``exact``: the reference in fp64 on the same inputs):
  * fp32: ``max |kernel - reference| <= 1e-6 M``;
  * bf16: the kernel's error against ``exact`` at most twice the bf16 reference's own error against
    ``exact`` plus one bf16 ulp of ``M``. (Measured: our kernels are bitwise the reference in bf16;
    Liger's RMSNorm input gradient, computed in fp32, is closer to ``exact`` than the reference's.)

``triton`` and ``liger-kernel`` are installed by tools/setup.sh (CPU wheels, no dependencies pulled):
this test runs, it does not skip, after the set-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = ["rotary rd=16", "rotary rd=8", "rotary table [s,1,1,d]", "swiglu", "rms_norm", "rms_norm+residual"]
TENSORS = {"rotary rd=16": 3, "rotary rd=8": 3, "rotary table [s,1,1,d]": 3, "swiglu": 2, "rms_norm": 3,
           "rms_norm+residual": 5}  # outputs + input gradients per case
FP32_REL = 1e-6


@pytest.fixture(scope="module")
def measured():
    """The subprocess's report: ``{(case, dtype): [rows]}`` (fails, not skips, where Triton or Liger is missing)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_interpreter_cases.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    summary = rows[-1]
    assert summary.get("done") and summary["liger"], f"liger-kernel is not importable here: {summary}"
    table: dict[tuple[str, str], list[dict]] = {}
    for row in rows[:-1]:
        table.setdefault((row["case"], row["dtype"]), []).append(row)
    return table


@pytest.mark.parametrize("case", CASES)
def test_fp32_kernel_matches_the_reference(measured, case):
    rows = measured[(case, "float32")]
    assert len(rows) == TENSORS[case]
    for row in rows:
        assert row["err"] <= FP32_REL, row


@pytest.mark.parametrize("case", CASES)
def test_bf16_kernel_within_the_references_own_error(measured, case):
    rows = measured[(case, "bfloat16")]
    assert len(rows) == TENSORS[case]
    for row in rows:
        assert row["ref_err"] < 4 * row["ulp"], row  # the reference itself is a bf16 result (sanity of `exact`)
        assert row["kernel_err"] <= 2 * row["ref_err"] + row["ulp"], row
