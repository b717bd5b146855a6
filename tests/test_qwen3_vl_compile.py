"""Qwen3-VL with ``compile=True`` (each decoder layer through ``torch.compile``, inductor on CPU; the vision
tower stays eager) trained on images: two SGD steps next to the eager model and transformers on a padded
batch of two images of different sizes and a video (the DeepStack features added between compiled layers, on each
rank's own tokens) under TP2+SP and CP2, on the suite's 2-rank workers (mostly inductor time); the same fp32
tolerances as tests/test_compile.py.
(A packed batch, checked once against the eager model, costs a second compilation: not repeated here.)
"""

from __future__ import annotations

import pytest

from parallel import ParallelConfig
from tests.distributed import records_on_ranks
from tests.workers_compile import compile_images_suite
from tests.workers_qwen3_vl import write_qwen3_vl_model

FP32_TOL = 1e-5
GRAD_REL_TOL = 1e-4
# the DeepStack features reach each rank's own SP shard between compiled layers (CP2 too, checked once: +45 s)
LAYOUTS = [{"tp": 2, "sequence_parallel": True}]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    from models.common.compiled_layers import CompileUnavailableError, check_compile_backend

    try:
        check_compile_backend("cpu")
    except CompileUnavailableError as exc:
        pytest.skip(str(exc))
    path = write_qwen3_vl_model(tmp_path_factory.mktemp("qwen3_vl_compile"), "q3_untied", seed=21)
    return records_on_ranks(2, compile_images_suite, path, LAYOUTS)


def test_compiled_qwen3_vl_trains_on_images_like_eager_and_transformers(records):
    for layout in LAYOUTS:  # every layout reported, each metric once per rank
        mine = [what for case, what, _ in records if case == ParallelConfig(**layout).describe()]
        assert len(mine) == 2 * len(set(mine)) and set(mine) >= {
            "loss_step1", "grads_step1", "loss_vs_eager_step1", "eager_grads_step1"}, records
    bad = [f"{case} {what}={value:.3g}" for case, what, value in records if what != "compiled_graphs"
           and not value <= (GRAD_REL_TOL if "grads" in what else FP32_TOL)]
    assert not bad, "; ".join(bad)


def test_the_text_layers_really_ran_compiled(records):
    graphs = [value for _, what, value in records if what == "compiled_graphs"]
    assert len(graphs) == 2 and min(graphs) >= 1, records  # per rank
