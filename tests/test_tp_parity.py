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
# The bf16 layouts that compute what one process computes: one process, and TP2+SP with
# ParallelConfig.tp_reduce_in_fp32 (the row-parallel partials summed in fp32 and rounded once, as one GEMM does):
# bitwise transformers' bf16 here (logits 0, |dloss| <= 4.8e-7 on every case, 2026-11-29). 0.5% of max |logit|
# leaves room for one-bit flips of another CPU's summation order and catches the RMSNorm-in-bf16 mutation, which
# the 2% bound does not.
BF16_EXACT_REL_TOL = 0.005
BF16_EXACT_LOSS_TOL = 1e-3
FP32_SUM_CASES = ("qwen3_untied", "qwen3moe_norm")
# after two SGD steps (lr 0.5): our fp32 error against transformers run in fp64 through the same steps, in
# units of transformers' own fp32 error (tests/workers.py fp32_error_ratio); measured <= 0.6 on these cases
AFTER_STEPS_FP32_RATIO = 4.0


def _limit(metric: str, world: int = 2):
    """(kind, bound) each metric must satisfy (at ``world`` ranks: one process takes the exact bf16 bounds)."""
    if metric == "loss_change":
        return "min", 1e-3  # the optimizer steps actually moved the model
    if metric == "read_fraction_excess":
        return "max", 0.15  # replicated norms/biases and replicated KV heads only; a full read is >= 0.5
    if metric == "local_logits_shape_ok":
        return "max", 0.0
    if metric.startswith("grads_step"):
        return "max", GRAD_REL_TOL
    if metric in ("tp_fp32sum_logits_rel", "tp_fp32sum_layer_rel", "tp_fp32sum_lora_rel") or (
            metric == "bf16_logits_rel" and world == 1):
        return "max", BF16_EXACT_REL_TOL
    if metric == "tp_fp32sum_loss" or (metric == "bf16_loss" and world == 1):
        return "max", BF16_EXACT_LOSS_TOL
    if metric == "bf16_logits_rel":
        return "max", BF16_LOGITS_REL_TOL
    if metric == "bf16_loss":
        return "max", BF16_LOSS_TOL
    if metric in ("tp_fp32sum_grads_vs_default", "tp_fp32sum_fp32_noop"):
        return "max", 0.0
    if metric == "tp_fp32sum_default_differs":
        return "min", 1.0
    if metric == "bf16_vs_fp32_ratio":
        return "max", BF16_VS_FP32_RATIO
    if metric in ("logits_after_steps", "loss_after_steps"):
        return "max", AFTER_STEPS_FP32_RATIO
    return "max", FP32_TOL


@functools.lru_cache(maxsize=None)
def _suite(world: int, dirs_key: tuple) -> list[tuple]:
    dirs, fp32_sum_dirs = (dict(part) for part in dirs_key)
    per_rank = run_distributed(world, parity_suite, dirs, world == 2 or world == 1, fp32_sum_dirs)
    return [rec for rank_records in per_rank for rec in rank_records]


def _check(records, metric_pattern: str):
    pat = re.compile(metric_pattern)
    selected = [r for r in records if pat.fullmatch(r[3])]
    assert selected, f"no records match {metric_pattern}"
    bad = []
    for case, world, sp, metric, value in selected:
        kind, bound = _limit(metric, world)
        if (kind == "max" and not value <= bound) or (kind == "min" and not value >= bound):
            bad.append(f"{case} tp={world} sp={sp} {metric}={value:.6g} ({kind} {bound})")
    assert not bad, "\n".join(bad)


@pytest.fixture(scope="module")
def dirs_key(hf_dirs):
    """The parity cases, and the Qwen3 / Qwen3-MoE cases run only for ``tp_reduce_in_fp32`` (from the session's
    checkpoint cache: tests/test_qwen3.py's configs)."""
    from tests.cases import qwen3_configs, write_hf_model
    from tests.checkpoint_cache import cached

    configs = qwen3_configs()
    fp32_sum = {name: str(cached(write_hf_model, name, configs[name], seed=i))
                for i, name in enumerate(configs) if name in FP32_SUM_CASES}
    return tuple(sorted(hf_dirs.items())), tuple(sorted(fp32_sum.items()))


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


def test_tp_reduce_in_fp32_gives_transformers_bf16(dirs_key):
    """``ParallelConfig(tp_reduce_in_fp32=True)`` at TP2+SP in bf16 against transformers' bf16 (every parity case,
    Qwen3 and Qwen3-MoE): within BF16_EXACT_REL_TOL (bitwise on the development CPU); the layer alone against
    ``nn.Linear`` and peft's LoRA, its gradients the default path's bitwise, a no-op in fp32."""
    records = _suite(2, dirs_key)
    _check(records, r"tp_fp32sum_.*")
    assert {r[0] for r in records if r[3] == "tp_fp32sum_logits_rel"} >= set(FP32_SUM_CASES)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_tp_reduce_in_fp32_must_be_a_bool(value):
    """Validated with the other ParallelConfig fields, before any group exists, naming the field and the value."""
    from parallel import ParallelConfig, ParallelConfigError

    with pytest.raises(ParallelConfigError, match=rf"tp_reduce_in_fp32 must be True or False, got {value!r}"):
        ParallelConfig(tp=2, tp_reduce_in_fp32=value)
    assert "tp_reduce=fp32" in ParallelConfig(tp=2, tp_reduce_in_fp32=True).describe()
    assert "tp_reduce" not in ParallelConfig(tp=2).describe()
