"""TP x SP parity with transformers: logits, loss, gradients and optimizer steps (gloo, CPU).

For each world size (= TP size) one group of processes runs every case; each rank compares against
a transformers model loaded from the same directory. Thresholds are fp32 parity (1e-5) except
where a test names another (bf16: see docs/numerics.md).
"""

from __future__ import annotations

import functools
import re

import pytest

from tests.distributed import run_distributed
from tests.workers import parity_suite

FP32_TOL = 1e-5
GRAD_REL_TOL = 1e-4  # relative to the largest |grad| of the tensor
# bf16 bounds: measured worst case x margin (docs/numerics.md). RMSNorm without its fp32 upcast gives
# 1.65% / 3.8e-3 / 1.36 on these cases: the loss bound catches it (the old 5% / 0.02 / 2 did not).
BF16_LOGITS_REL_TOL = 0.02  # max |Δlogit| / max |logit|, ours-bf16 vs transformers-bf16 (measured 1.24%)
# measured 4.7e-4 (2026-11-22) and 1.72e-3 at TP2 on an AMD EPYC CPU (2026-11-26: bf16 GEMM roundings differ by
# CPU, and TP's all-reduce reorders them); the RMSNorm-in-bf16 mutation gives 3.8e-3 / 4.5e-3 at TP1 (caught)
BF16_LOSS_TOL = 3e-3
BF16_VS_FP32_RATIO = 1.5  # our bf16 error / transformers' bf16 error vs fp32 (measured 1.27)
# after two SGD steps (lr 0.5): our fp32 error against transformers run in fp64 through the same steps, in
# units of transformers' own fp32 error (tests/workers.py fp32_error_ratio); measured <= 0.6 on these cases
AFTER_STEPS_FP32_RATIO = 4.0


def _limit(metric: str):
    """(kind, bound) each metric must satisfy."""
    if metric == "loss_change":
        return "min", 1e-3  # the optimizer steps actually moved the model
    if metric == "read_fraction_excess":
        return "max", 0.15  # replicated norms/biases and replicated KV heads only; a full read is >= 0.5
    if metric == "local_logits_shape_ok":
        return "max", 0.0
    if metric.startswith("grads_step"):
        return "max", GRAD_REL_TOL
    if metric == "bf16_logits_rel":
        return "max", BF16_LOGITS_REL_TOL
    if metric == "bf16_loss":
        return "max", BF16_LOSS_TOL
    if metric == "bf16_vs_fp32_ratio":
        return "max", BF16_VS_FP32_RATIO
    if metric in ("logits_after_steps", "loss_after_steps"):
        return "max", AFTER_STEPS_FP32_RATIO
    return "max", FP32_TOL


@functools.lru_cache(maxsize=None)
def _suite(world: int, dirs_key: tuple) -> list[tuple]:
    dirs = dict(dirs_key)
    per_rank = run_distributed(world, parity_suite, dirs, world == 2 or world == 1)
    return [rec for rank_records in per_rank for rec in rank_records]


def _check(records, metric_pattern: str):
    pat = re.compile(metric_pattern)
    selected = [r for r in records if pat.fullmatch(r[3])]
    assert selected, f"no records match {metric_pattern}"
    bad = []
    for case, world, sp, metric, value in selected:
        kind, bound = _limit(metric)
        if (kind == "max" and not value <= bound) or (kind == "min" and not value >= bound):
            bad.append(f"{case} tp={world} sp={sp} {metric}={value:.6g} ({kind} {bound})")
    assert not bad, "\n".join(bad)


@pytest.fixture(scope="module")
def dirs_key(hf_dirs):
    return tuple(sorted(hf_dirs.items()))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("metric", ["logits", "local_logits.*", "loss", "grads_step.*",
                                    "logits_after_steps|loss_after_steps", "loss_change", "read_fraction_excess"])
def test_parity_with_transformers(world, metric, dirs_key):
    _check(_suite(world, dirs_key), metric)


@pytest.mark.parametrize("world", [1, 2])
def test_packed_equals_padded_and_transformers(world, dirs_key):
    _check(_suite(world, dirs_key), r"packed_.*|padded_.*")


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_within_documented_tolerance(world, dirs_key):
    _check(_suite(world, dirs_key), r"bf16_.*")
