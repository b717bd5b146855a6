"""Qwen3.5-MoE and Qwen3-Next in the training layouts (tests/test_hybrid_moe_training.py), against
transformers fp32 loaded from the same directory. Records are ``(model, layout, metric, value)``; the test
holds the bounds.

  * FSDP2 over dp2 and ``recompute="full"`` (Qwen3.5-MoE at EP2, Qwen3-Next at TP2+SP): the per-sequence
    case of tests/workers_qwen3_next.py (padded batch with the load-balancing loss: logits, loss, aux loss,
    every HF tensor's gradient; packed sequences against each sequence alone in transformers; save_pretrained
    bitwise; an SGD step, then the padded batch again). FSDP2 runs at ep=1: the builder refuses FSDP2 with
    expert parallelism (the EP ranks of a replica mesh hold different experts), as for Qwen3-MoE;
  * ``compile=True`` (Qwen3.5-MoE at EP2, Qwen3-Next at TP2): tests/workers_compile.py's side-by-side loop
    (two SGD steps of the compiled model next to the eager one and transformers, the aux loss in the loss),
    with the gradients under transformers' per-expert names;
  * the loader on a checkpoint whose experts are stored fused (transformers' in-memory tensors saved as
    they are): Qwen3.5-MoE at EP2, every parameter bitwise the per-expert checkpoint's model, logits against
    transformers, and the experts each rank read (its own only).
"""

from __future__ import annotations

import importlib
import re

import torch
import torch.distributed as dist

from parallel import ParallelConfig
from tests.workers import _max_diff
from tests.workers_qwen3_5 import _padded_batch
from tests.workers_qwen3_5_layouts import LR
from tests.workers_qwen3_next import FOLDERS, _grad_rel, case


def compile_case(path: str, kwargs: dict, steps: int = 2) -> list[tuple]:
    """tests/workers_compile.train_side_by_side: each step the compiled model, the eager model and transformers
    take the same batch (right and left padding, ignored labels, the load-balancing loss), record the loss
    against both and both models' gradients (relative, per-expert names) and transformers' aux loss, then an
    SGD step."""
    from transformers import AutoModelForCausalLM

    from tests.workers_compile import train_side_by_side
    from tests.workers_fused_loss import batch

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    name = FOLDERS[hf.config.model_type]
    build = importlib.import_module(f"models.{name}").build_parallel_model
    pconfig = ParallelConfig(**kwargs)
    compiled, eager = build(path, pconfig, compile=True), build(path, pconfig)
    tag = (name, f"{pconfig.describe()} compile")
    ids, mask, labels = batch(hf.config.vocab_size)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels, "output_router_logits": True}
    records = train_side_by_side(tag, compiled, eager, hf, inputs, inputs, pipeline=False, lr=LR, steps=steps,
                                 grad_diff=_grad_rel, prefix="compile_", eager_grads=True,
                                 extra=lambda ref: [("aux_loss_value", ref.aux_loss.item())])
    from torch._dynamo.utils import counters

    return records + [(*tag, "compiled_no_graphs", float(counters["stats"]["unique_graphs"] == 0))]


class _Recording:
    """A TensorSource that remembers which tensors were read (the experts a rank asked for)."""

    def __init__(self, source) -> None:
        self.source, self.read_names = source, set()
        self.names, self.shape = source.names, source.shape

    def read(self, name, piece, dtype=None):
        self.read_names.add(name)
        return self.source.read(name, piece, dtype)


def fused_experts_case(fused: str, per_expert: str, kwargs: dict) -> list[tuple]:
    """Qwen3.5-MoE from a fused-expert checkpoint: the loader's own directory path (parameters bitwise the
    per-expert checkpoint's, logits against transformers) and the same source recorded (experts read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.common.weights import checkpoint_source
    from models.qwen3_5_moe import ARCHITECTURE, build_parallel_model

    pconfig = ParallelConfig(**kwargs)
    tag = ("qwen3_5_moe", f"{pconfig.describe()} fused experts")
    model, plain = build_parallel_model(fused, pconfig), build_parallel_model(per_expert, pconfig)
    ours, theirs = dict(model.named_parameters()), dict(plain.named_parameters())
    differ = sum(not torch.equal(p, theirs[n]) for n, p in ours.items()) + len(set(ours) ^ set(theirs))
    hf = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32).eval()
    ids, mask, _ = _padded_batch(hf.config.vocab_size, 24, right=17, left=6)
    with torch.no_grad():
        logits = model.eval()(ids, attention_mask=mask, gather_logits=True).logits
        ref = hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    hf_config = AutoConfig.from_pretrained(fused)
    recorded = _Recording(checkpoint_source(fused, ARCHITECTURE.model_config(hf_config)))
    build_parallel_model((hf_config, recorded), pconfig)
    experts = hf_config.num_experts
    mine = set(range(model.groups.ep_rank * experts // pconfig.ep, (model.groups.ep_rank + 1) * experts // pconfig.ep))
    read = {int(m.group(1)) for n in recorded.read_names if (m := re.search(r"\.mlp\.experts\.(\d+)\.", n))}
    return [(*tag, "params_not_bitwise", float(differ)), (*tag, "fused_logits", _max_diff(logits[real], ref[real])),
            (*tag, "foreign_experts_read", float(len(read - mine))),
            (*tag, "own_experts_unread", float(len(mine - read))), (*tag, "experts_read", float(len(read)))]


def suite(dirs: dict[str, str], plan: list[tuple[str, dict]], compiles: list[tuple[str, dict]],
          fused: tuple[str, str, dict]) -> list[tuple]:
    """Every case on every rank of one 2-rank group: ``plan`` (model, kwargs) per-sequence cases,
    ``compiles`` (model, kwargs), ``fused`` (fused dir, per-expert dir, kwargs)."""
    assert dist.get_world_size() == 2
    records = [r for name, kwargs in plan for r in case(dirs[name], ParallelConfig(**kwargs))]
    records += [r for name, kwargs in compiles for r in compile_case(dirs[name], kwargs)]
    return records + fused_experts_case(*fused)
