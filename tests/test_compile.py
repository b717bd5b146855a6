"""``build_parallel_model(..., compile=True)``: each decoder layer through ``torch.compile`` (inductor on
CPU), trained two SGD steps next to transformers under TP+SP with full recompute, context parallelism
on packed sequences, FSDP2 and a pipeline (tests/workers_compile.py): the same fp32 tolerances as the
eager model. Bad input: a compiler that does not exist and a ``compile`` value that is not a bool
fail in one line before anything is built.
"""

from __future__ import annotations

import functools

import pytest

from tests.distributed import run_distributed
from tests.workers_compile import compile_suite

FP32_TOL = 1e-5
GRAD_REL_TOL = 1e-4

# one model for every layout: layouts with the same local shapes reuse each other's compiled graphs
LAYOUTS = [
    ("qwen2_untied", {"tp": 2, "sequence_parallel": True, "recompute": "full"}),
    ("qwen2_untied", {"cp": 2}),
    ("qwen2_untied", {"fsdp": True}),  # dp 2: both ranks take the whole batch
    ("qwen2_untied", {"pp": 2}),
]


@functools.lru_cache(maxsize=None)
def _records(dirs: tuple) -> list[tuple]:
    per_rank = run_distributed(2, compile_suite, dict(dirs), LAYOUTS)
    return [rec for rank in per_rank for rec in rank]


@pytest.mark.parametrize("metric", ["loss", "grads", "loss_vs_eager"])
def test_compiled_layers_train_like_transformers(hf_dirs, metric):
    records = [r for r in _records(tuple(sorted(hf_dirs.items()))) if r[1].startswith(f"{metric}_step")]
    assert len({r[0] for r in records}) == len(LAYOUTS), records  # every layout reported
    bound = GRAD_REL_TOL if metric == "grads" else FP32_TOL
    bad = [f"{layout} {what}={value:.3g}" for layout, what, value in records if not value <= bound]
    assert not bad, "; ".join(bad)


def test_layers_really_ran_compiled(hf_dirs):
    graphs = [value for _, what, value in _records(tuple(sorted(hf_dirs.items()))) if what == "compiled_graphs"]
    assert len(graphs) == 2 and min(graphs) >= 1, graphs  # per rank


def test_no_working_compiler_is_one_line_before_anything_is_built(hf_dirs):
    from torch._inductor import config as inductor_config

    from models.common.compiled_layers import CompileUnavailableError
    from models.qwen2 import build_parallel_model

    # torch's own patcher: monkeypatch's undo of a config-module attribute leaves it hidden ("cpp.cxx does not
    # exist") for every later test in the process (test_kernel_dispatch's CPU backend check failed on it)
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",)}), pytest.raises(
            CompileUnavailableError, match=r"needs a C\+\+ compiler .*tried /nonexistent/c\+\+") as err:
        build_parallel_model(hf_dirs["qwen2_untied"], compile=True)
    assert inductor_config.cpp.cxx != ("/nonexistent/c++",)  # restored, and readable
    assert "\n" not in str(err.value)


def test_compile_must_be_a_bool(hf_dirs):
    from models.qwen2 import build_parallel_model

    with pytest.raises(ValueError, match=r"compile='yes': expected True or False"):
        build_parallel_model(hf_dirs["qwen2_untied"], compile="yes")
