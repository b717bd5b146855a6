"""Qwen3-VL with ``compile=True`` (each decoder layer through ``torch.compile``, inductor on CPU; the vision
tower stays eager) trained on images: two SGD steps next to the eager model and transformers on a padded
batch of two images of different sizes and a video (the DeepStack features added between compiled layers).
One process, world 1, ~20 CPU-seconds (mostly inductor); the same fp32 tolerances as tests/test_compile.py.
(A packed batch, checked once against the eager model, costs a second compilation: not repeated here.)
"""

from __future__ import annotations

import pytest
import torch

from tests.workers import _rel_diff, hf_named_grads
from tests.workers_compile import train_side_by_side
from tests.workers_qwen3_vl import qwen3_vl_batch, write_qwen3_vl_model
from tests.workers_vl import _inputs

FP32_TOL = 1e-5
GRAD_REL_TOL = 1e-4


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    from torch._dynamo.utils import counters
    from transformers import Qwen3VLForConditionalGeneration

    from models.common.compiled_layers import CompileUnavailableError, check_compile_backend
    from models.qwen3_vl import build_parallel_model

    try:
        check_compile_backend("cpu")
    except CompileUnavailableError as exc:
        pytest.skip(str(exc))
    path = write_qwen3_vl_model(tmp_path_factory.mktemp("qwen3_vl_compile"), "q3_untied", seed=21)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    compiled, eager = build_parallel_model(path, compile=True), build_parallel_model(path)
    graphs = counters["stats"]["unique_graphs"]

    def grad_diff(model, ref_model):
        ref = dict(ref_model.named_parameters())
        return max(_rel_diff(g, ref[n].grad) for n, g in hf_named_grads(model).items())

    batch = _inputs(qwen3_vl_batch("q3_untied", "images_and_video", seed=3))
    out = train_side_by_side(("padded",), compiled, eager, hf, batch, batch, pipeline=False, lr=0.5,
                             grad_diff=grad_diff, eager_grads=True)
    out.append(("all", "compiled_graphs", counters["stats"]["unique_graphs"] - graphs))
    torch._dynamo.reset()  # this process's compiled graphs are not kept for later tests
    return out


def test_compiled_qwen3_vl_trains_on_images_like_eager_and_transformers(records):
    metrics = {what for _, what, _ in records}
    assert metrics >= {"loss_step1", "grads_step1", "loss_vs_eager_step1", "eager_grads_step1"}, records
    bad = [f"{case} {what}={value:.3g}" for case, what, value in records if what != "compiled_graphs"
           and not value <= (GRAD_REL_TOL if "grads" in what else FP32_TOL)]
    assert not bad, "; ".join(bad)


def test_the_text_layers_really_ran_compiled(records):
    graphs = [value for _, what, value in records if what == "compiled_graphs"]
    assert graphs and graphs[0] >= 1, records
