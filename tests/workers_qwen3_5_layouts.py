"""Qwen3.5 (dense, text) rank bodies for the training layouts (tests/test_qwen3_5_layouts.py): the shared
harnesses of the other models applied to the Gated DeltaNet hybrid, against transformers fp32 loaded
from the same directory. Records are ``(case, layout, metric, value)``; the test holds the bounds.

  * PP2 (1F1B) and PP2 x VPP2 (interleaved 1F1B): two SGD steps of ``forward_backward`` next to
    transformers (loss, every HF tensor's gradient), then forward-only log-probs
    (``tests/workers_pipeline.train_next_to_transformers``); tied embeddings split over the stages;
  * FSDP2 over dp2, ``recompute="full"`` at TP2+SP: the same steps, the weights exported after them;
  * ``compile=True`` at TP2: an SGD step of the model call next to transformers and the eager model;
  * the fused head (training mode, labels: logits None) against the materialised head: loss, grads;
  * LoRA at TP2+SP on every linear projection of both mixers and the MLP, against peft
    (``tests/workers_lora.lora_case``): logits, LoRA gradients, the saved adapter in peft, merge;
  * ``iter_export("hf")`` after training and ``save_pretrained`` (bitwise equal to the export,
    loaded by transformers: its log-probs equal ours) (``tests/workers_export.export_case``).
"""

from __future__ import annotations

import torch.distributed as dist

from parallel import ParallelConfig
from tests.workers_export import _parameter_of as _SHARED_PARAMETER_OF
from tests.workers_pipeline import _tied_copies_equal, train_next_to_transformers

# SGD step size of the training layouts. This randomized hybrid's gradients are sensitive to its weights:
# transformers itself, run at weights 7e-6 away from its own after two steps of lr 0.1, moves its
# gradients by 1e-3 relative (ours at those same weights: 4e-6), and the fp32 rounding of a step grows
# chaotically with lr (measured at TP1: step-2 gradients 2e-5 at lr 0.02, 3e-3 at 0.05, 1e-4 at 0.5).
# A small step keeps two steps inside fp32 tolerances; step 0 is exact at any lr.
LR = 0.02
LORA_TARGETS = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj", "v_proj",
                "o_proj", "gate_proj", "up_proj", "down_proj"]


def _build(path: str, pconfig: ParallelConfig, **kw):
    from models.qwen3_5 import build_parallel_model

    return build_parallel_model(path, pconfig, **kw)


def _hf(path: str):
    from tests.cases import load_hf

    return load_hf(path)


def pipeline_case(name: str, path: str, kwargs: dict, schedule: str) -> list[tuple]:
    pconfig = ParallelConfig(**kwargs)
    model = _build(path, pconfig)
    tag = (name, f"{pconfig.describe()} {schedule}")
    records = train_next_to_transformers(model, _hf(path), tag, num_microbatches=2, schedule=schedule, lr=LR)
    return records + [(*tag, "tied_copies_differ", _tied_copies_equal(model))]


def training_case(name: str, path: str, kwargs: dict) -> list[tuple]:
    """FSDP2 / recompute: ``forward_backward`` steps and the export after them."""
    pconfig = ParallelConfig(**kwargs)
    model, hf = _build(path, pconfig), _hf(path)
    tag = (name, pconfig.describe())
    records = train_next_to_transformers(model, hf, tag, num_microbatches=2, lr=LR)
    exported, ref = dict(model.iter_hf_weights()), dict(hf.named_parameters())
    return records + [(*tag, "export_after_steps", max((t - ref[k]).abs().max().item() for k, t in exported.items()))]


def fused_head_case(name: str, path: str, kwargs: dict) -> list[tuple]:
    """Training mode with labels: the fused head returns no logits, the same loss and gradients as the
    materialised head (``return_logits=True``) and as transformers."""
    from tests.workers_fused_loss import batch, grad_error, grads_error, grads_of

    pconfig = ParallelConfig(**kwargs)
    tag = (name, f"{pconfig.describe()} fused head")
    model, hf = _build(path, pconfig, loss_chunk_tokens=5), _hf(path)
    model.train()
    ids, mask, labels = batch(hf.config.vocab_size)
    fused = model(ids, attention_mask=mask, labels=labels)
    fused.loss.backward()
    model.finalize_grads()
    fused_grads = grads_of(model)
    ref = hf(input_ids=ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    records = [(*tag, "fused_logits_returned", float(fused.logits is not None)),
               (*tag, "fused_loss", abs(fused.loss.item() - ref.loss.item())),
               (*tag, "fused_grads", grad_error(model, hf))]
    model.zero_grad()
    plain = model(ids, attention_mask=mask, labels=labels, return_logits=True)
    plain.loss.backward()
    model.finalize_grads()
    return records + [(*tag, "fused_vs_plain_loss", abs(fused.loss.item() - plain.loss.item())),
                      (*tag, "fused_vs_plain_grads", grads_error(fused_grads, grads_of(model)))]


def _compile(name: str, path: str, kwargs: dict, steps: int = 1) -> list[tuple]:
    """``tests/workers_compile.compile_case`` with this model's builder: SGD steps (one by default:
    compiling the hybrid's layers dominates the module's time) of the compiled model call next to the
    eager model and transformers, and a check that dynamo built graphs."""
    from tests.workers_compile import train_side_by_side
    from tests.workers_fused_loss import batch

    pconfig = ParallelConfig(**kwargs)
    tag = (name, f"{pconfig.describe()} compile")
    hf = _hf(path)
    ids, mask, labels = batch(hf.config.vocab_size)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    compiled, eager = _build(path, pconfig, compile=True), _build(path, pconfig)
    records = train_side_by_side(tag, compiled, eager, hf, inputs, inputs, pipeline=False, lr=LR, steps=steps)
    from torch._dynamo.utils import counters

    return records + [(*tag, "compiled_no_graphs", float(counters["stats"]["unique_graphs"] == 0))]


def lora_case(name: str, path: str, adapter: str, out_root: str, kwargs: dict) -> list[tuple]:
    from tests import workers_lora

    original = workers_lora.build
    workers_lora.build = lambda case, source, pconfig, **kw: _build(source, pconfig, **kw)
    try:
        records = workers_lora.lora_case(name, path, adapter, out_root, kwargs)
    finally:
        workers_lora.build = original
    return [(r[0], f"{r[1]} lora", r[3], r[4]) for r in records]


def export_case(name: str, path: str, kwargs: dict, out_dir: str) -> list[tuple]:
    from tests import workers_export

    original = workers_export.build, workers_export._parameter_of
    workers_export.build = lambda case, source, pconfig, **kw: _build(source, pconfig, **kw)
    workers_export._parameter_of = _packed_parameter_of  # which HF tensors travel packed together
    try:
        records = workers_export.export_case(name, path, kwargs, 1 << 14, lr=LR, out_dir=out_dir)
    finally:
        workers_export.build, workers_export._parameter_of = original
    return [(r[0], f"{r[1]} export", r[3], r[4]) for r in records]


def _packed_parameter_of(hf_name: str) -> str:
    for part, packed in ((".in_proj_qkv.", ".qkvz."), (".in_proj_z.", ".qkvz."), (".in_proj_b.", ".ba."),
                         (".in_proj_a.", ".ba.")):
        hf_name = hf_name.replace(part, packed)
    return _SHARED_PARAMETER_OF(hf_name)


def layouts_suite(dirs: dict[str, str], adapter: str, out_root: str) -> list[tuple]:
    """Every layout in one 2-rank group (the world size is 2)."""
    assert dist.get_world_size() == 2
    records = []
    records += pipeline_case("tied_kv1", dirs["tied_kv1"], dict(pp=2), "1f1b")
    records += pipeline_case("mixed", dirs["mixed"], dict(pp=2, vpp=2), "interleaved_1f1b")
    records += training_case("mixed", dirs["mixed"], dict(fsdp=True))
    records += training_case("mixed", dirs["mixed"], dict(tp=2, sequence_parallel=True, recompute="full"))
    records += fused_head_case("mixed", dirs["mixed"], dict(tp=2, sequence_parallel=True))
    records += _compile("tied_kv1", dirs["tied_kv1"], dict(tp=2))
    records += lora_case("mixed", dirs["mixed"], adapter, f"{out_root}/lora", dict(tp=2, sequence_parallel=True))
    records += export_case("mixed", dirs["mixed"], dict(tp=2), f"{out_root}/save")
    return records
