"""Rank bodies for tests/test_compile.py: ``compile=True`` models against transformers.

Every layout trains two SGD steps next to transformers on the same batch (right and left padding,
ignored labels; packed sequences under context parallelism) and records the loss and the largest
relative gradient difference of each step: the compiled model is held to the fp32 tolerances of the
eager one. The eager model of the same layout runs beside it, so the records also say how far
compilation moved the numbers (``*_vs_eager``). Records are ``(layout, what, value)``.
"""

from __future__ import annotations

import torch

from parallel import ParallelConfig
from tests.cases import build, load_hf
from tests.workers import _max_diff, _rel_diff, hf_named_grads
from tests.workers_fused_loss import batch, packed


def _grad_diff(model, hf) -> float:
    ref = dict(hf.named_parameters())
    return max(_rel_diff(g, ref[n].grad) for n, g in hf_named_grads(model).items())


def _step(model, inputs: dict, pipeline: bool) -> torch.Tensor:
    if pipeline:
        return model.forward_backward(inputs["input_ids"], inputs["labels"], num_microbatches=3,
                                      attention_mask=inputs.get("attention_mask"))
    loss = model(**inputs, return_logits=False).loss
    loss.backward()
    model.finalize_grads()
    return loss


def compile_case(case: str, path: str, kwargs: dict, lr: float = 0.5) -> list[tuple]:
    pconfig = ParallelConfig(**kwargs)
    tag = (f"{case} {pconfig.describe()}",)
    hf = load_hf(path)
    vocab = hf.config.vocab_size
    if pconfig.cp > 1:
        flat, cu, labels, rows, mask, row_labels = packed(vocab)
        inputs = {"input_ids": flat, "cu_seqlens": cu, "labels": labels}
        ref_inputs = {"input_ids": rows, "attention_mask": mask, "labels": row_labels}  # the same sequences
    else:
        ids, mask, labels = batch(vocab)
        inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        ref_inputs = inputs
    compiled = build(case, path, pconfig, compile=True)
    eager = build(case, path, pconfig)
    return train_side_by_side(tag, compiled, eager, hf, inputs, ref_inputs, pipeline=pconfig.pp > 1, lr=lr)


def train_side_by_side(tag: tuple, compiled, eager, hf, inputs: dict, ref_inputs: dict, *, pipeline: bool,
                       lr: float, steps: int = 2, grad_diff=_grad_diff, prefix: str = "", eager_grads: bool = False,
                       extra=None) -> list[tuple]:
    """SGD steps of the compiled model next to the eager one and transformers (``ref_inputs``: the same
    sequences in transformers' form): each step's loss against both, and the compiled model's gradients
    (``grad_diff(model, hf)``); ``eager_grads`` records the eager model's too (``eager_grads_step{n}``),
    ``extra(ref_output)`` more ``(metric, value)`` pairs of transformers' output (e.g. its aux loss); the
    compiled model's metric names and the extra ones start with ``prefix``."""
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (compiled, eager, hf)]
    records = []
    for step in range(steps):
        for opt in opts:
            opt.zero_grad()
        loss = _step(compiled, inputs, pipeline)
        eager_loss = _step(eager, inputs, pipeline)
        ref = hf(**ref_inputs)
        ref.loss.backward()
        records += [(*tag, f"{prefix}loss_step{step}", _max_diff(loss, ref.loss)),
                    (*tag, f"{prefix}grads_step{step}", grad_diff(compiled, hf)),
                    (*tag, f"{prefix}loss_vs_eager_step{step}", _max_diff(loss, eager_loss))]
        if eager_grads:
            records.append((*tag, f"eager_grads_step{step}", grad_diff(eager, hf)))
        records += [(*tag, f"{prefix}{metric}_step{step}", value) for metric, value in (extra(ref) if extra else ())]
        for opt in opts:
            opt.step()
    return records


def compile_suite(dirs: dict[str, str], layouts: list[tuple]) -> list[tuple]:
    from torch._dynamo.utils import counters

    records = []
    for case, kwargs in layouts:
        records += compile_case(case, dirs[case], kwargs)
    # graphs dynamo built in this process: 0 would mean the "compiled" model ran eagerly
    return records + [("all layouts", "compiled_graphs", counters["stats"]["unique_graphs"])]


def compile_images_suite(path: str, layouts: list[dict]) -> list[tuple]:
    """Qwen3-VL with ``compile=True`` next to the eager model and transformers on the padded batch of two images
    of different sizes and a video (tests/test_qwen3_vl_compile.py), in each layout of ``layouts`` (the DeepStack
    features added on each rank's own tokens between compiled layers: SP shards, CP chunks)."""
    from torch._dynamo.utils import counters
    from transformers import Qwen3VLForConditionalGeneration

    from models.qwen3_vl import build_parallel_model
    from tests.workers_qwen3_vl import qwen3_vl_batch
    from tests.workers_vl import _inputs

    records = []
    graphs = counters["stats"]["unique_graphs"]
    batch = _inputs(qwen3_vl_batch("q3_untied", "images_and_video", seed=3))
    for kwargs in layouts:
        pconfig = ParallelConfig(**kwargs)
        hf = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
        compiled, eager = build_parallel_model(path, pconfig, compile=True), build_parallel_model(path, pconfig)
        records += train_side_by_side((pconfig.describe(),), compiled, eager, hf, batch, batch, pipeline=False,
                                      lr=0.5, eager_grads=True)
    records.append(("all layouts", "compiled_graphs", counters["stats"]["unique_graphs"] - graphs))
    torch._dynamo.reset()  # the rank's compiled graphs are not kept for the module's later calls
    return records
