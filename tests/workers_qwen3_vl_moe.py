"""Qwen3-VL-MoE cases and worker bodies (run on every rank by tests/test_qwen3_vl_moe.py): our parallel model
against transformers' ``Qwen3VLMoeForConditionalGeneration`` loaded from the same directory in the same
process. Records are ``(case, layout, metric, value)``; the test file holds the bounds.

The cases are tests/workers_qwen3_vl.py's two Qwen3-VL cases (tower, DeepStack ``[0, 2]`` / ``[1, 0]``,
M-RoPE sections, tying, bias) with Qwen3-MoE text layers: 4 experts, top-2, ``moe_intermediate_size`` 48 /
40 (``2F != hidden``, so a transposed expert tensor cannot pass for transformers' layout), one with a dense
layer (``mlp_only_layers=[1]``), the other with the load-balancing loss on (``output_router_logits``:
transformers adds ``router_aux_loss_coef * aux_loss`` to the loss). Their vision fields and special tokens
are the Qwen3-VL cases', so the batches are that module's (``qwen3_vl_batch(BASE[case], ...)``).

Gradients: transformers holds each layer's experts fused (``mlp.experts.gate_up_proj [E, 2F, H]``,
``down_proj [E, H, F]``), our exports name them per expert; ``_fused_grads`` stacks ours back into
transformers' tensors, so each layer's experts are compared as one tensor (relative to its largest entry).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch

from parallel import ParallelConfig
from tests.cases import save_randomized
from tests.workers import _max_diff, _rel_diff, hf_named_grads
from tests.workers_qwen3_vl import QWEN3_VL_CASES, _packed_reference, bf16_parity, qwen3_vl_batch, qwen3_vl_packed_batch
from tests.workers_vl import _inputs, _unscored_padding_predictions

BASE = {"m_untied": "q3_untied", "m_tied": "q3_tied"}  # the Qwen3-VL case each MoE case extends
_MOE = {"m_untied": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                     "mlp_only_layers": [1]},
        "m_tied": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
                   "output_router_logits": True, "router_aux_loss_coef": 0.02}}
QWEN3_VL_MOE_CASES = {name: {**copy.deepcopy(QWEN3_VL_CASES[BASE[name]])} for name in BASE}
for _name, _fields in _MOE.items():
    QWEN3_VL_MOE_CASES[_name]["text_config"].update(_fields)
_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def qwen3_vl_moe_config(name: str):
    from transformers import Qwen3VLMoeConfig

    return Qwen3VLMoeConfig(**copy.deepcopy(QWEN3_VL_MOE_CASES[name]))


def write_qwen3_vl_moe_model(root, name: str, seed: int = 0) -> str:
    """Random ``Qwen3VLMoeForConditionalGeneration`` of ``QWEN3_VL_MOE_CASES[name]`` saved by transformers under
    ``root/name``: norm weights uniform(0.5, 1.5), everything else (biases, router, experts) normal(0, 0.08)."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(qwen3_vl_moe_config(name))
    return save_randomized(model, Path(root) / name)


def _fused_grads(model) -> dict[str, torch.Tensor]:
    """Our gradients under transformers' in-memory names: per-expert tensors stacked into the layer's fused
    ``gate_up_proj [E, 2F, H]`` (gate rows, then up rows) and ``down_proj [E, H, F]``."""
    out, experts = {}, {}
    for name, grad in hf_named_grads(model).items():
        match = _EXPERT.fullmatch(name)
        if match is None:
            out[name] = grad
        else:
            prefix, e, part = match.groups()
            experts.setdefault(prefix, {})[(int(e), part)] = grad
    for prefix, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]])
                                                    for e in range(count)])
        out[prefix + "down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(count)])
    return out


def _grad_diffs(model, hf) -> dict[str, float]:
    """Largest relative gradient difference per part (tower, text, head); 0: this pipeline stage holds none."""
    ours = _fused_grads(model)
    ref = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    out = {}
    for part, prefix in (("vision", "model.visual."), ("text", "model.language_model."), ("head", "lm_head.")):
        names = [n for n in ours if n.startswith(prefix)]
        out[part] = (float("inf") if any(n not in ref for n in names)
                     else max((_rel_diff(ours[n], ref[n]) for n in names), default=0.0))
    return out


def parity(case: str, path: str, pconfig: ParallelConfig, lr: float = 0.2, save: bool = False) -> list[tuple]:
    """Logits and loss (the load-balancing loss included where the case turns it on) on the images-and-video
    batch (right padding) and the mixed one (left padding), the packed batch against each sequence alone
    (load-balancing loss off on both sides: transformers' would be per sequence), then two SGD steps on the
    images-and-video batch with every gradient compared. ``save``: then ``save_pretrained`` of the trained
    model (experts gathered over TP/EP and stored fused) read by transformers: its logits against transformers'
    trained model (``saved_logits``; a missing or unexpected key records infinity)."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from models.qwen3_vl_moe import build_parallel_model

    tag, base = (case, pconfig.describe()), BASE[case]
    hf = Qwen3VLMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model = build_parallel_model(path, pconfig)
    records = []
    for kind, side in (("images_and_video", "right"), ("mixed", "left")):
        batch = qwen3_vl_batch(base, kind, padding_side=side)
        if side == "left":
            batch = _unscored_padding_predictions(batch)
        with torch.no_grad():
            ours, ref = model(**_inputs(batch), gather_logits=True), hf(**_inputs(batch))
        valid = batch["attention_mask"].bool()
        records += [(*tag, f"logits_{kind}_{side}", _max_diff(ours.logits[valid], ref.logits[valid])),
                    (*tag, f"loss_{kind}_{side}", _max_diff(ours.loss, ref.loss))]
        if ref.aux_loss is not None:
            records.append((*tag, f"loss_aux_{kind}_{side}", _max_diff(ours.aux_loss, ref.aux_loss)))
    packed = qwen3_vl_packed_batch(base)
    aux, hf.config.text_config.output_router_logits = hf.config.text_config.output_router_logits, False
    with torch.no_grad():
        ours = model(**_inputs(packed), gather_logits=True, output_router_logits=False)
        ref_logits, ref_loss = _packed_reference(hf, packed)
    hf.config.text_config.output_router_logits = aux
    records += [(*tag, "logits_packed", _max_diff(ours.logits[0], ref_logits)),
                (*tag, "loss_packed", _max_diff(ours.loss, ref_loss))]
    batch = _inputs(qwen3_vl_batch(base, "images_and_video"))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(hf.parameters(), lr=lr)
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model(**batch, return_logits=False).loss
        loss.backward()
        model.finalize_grads()
        ref_loss = hf(**batch).loss
        ref_loss.backward()
        records.append((*tag, f"step{step}_loss", _max_diff(loss, ref_loss)))
        records += [(*tag, f"grads_{part}_step{step}", value) for part, value in _grad_diffs(model, hf).items()]
        opt.step()
        ref_opt.step()
    if save:
        out = Path(path).parent / f"saved-{case}-{pconfig.describe()}".replace(" ", "_")
        model.save_pretrained(out)
        saved, info = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32,
                                                                          output_loading_info=True)
        valid = batch["attention_mask"].bool()
        with torch.no_grad():
            diff = _max_diff(saved.eval()(**batch).logits[valid], hf.eval()(**batch).logits[valid])
        clean = not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
        records.append((*tag, "saved_logits", diff if clean else float("inf")))
    return records


def training_parity(case: str, path: str, pconfig: ParallelConfig, microbatches: int = 2,
                    aux: bool = False) -> list[tuple]:
    """``forward_backward`` (micro-batches; pipeline stages) against transformers: loss and every gradient.
    Without ``aux``: the images-and-video batch, then the packed one, the load-balancing loss off on both
    sides. With ``aux``: the images-and-video batch twice, in one micro-batch (gpipe), the loss including
    ``router_aux_loss_coef`` times the load-balancing loss as the case's config asks (transformers computes
    it over the batch it is given: one micro-batch is the same batch), its statistics carried across the
    pipeline stages beside the DeepStack tensor."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from models.qwen3_vl_moe import build_parallel_model

    tag, base = (case, f"{pconfig.describe()} forward_backward({microbatches}){' aux' if aux else ''}"), BASE[case]
    hf = Qwen3VLMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    hf.config.text_config.output_router_logits = aux
    model = build_parallel_model(path, pconfig)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.2), torch.optim.SGD(hf.parameters(), lr=0.2)
    padded = qwen3_vl_batch(base, "images_and_video")
    records = []
    for step, batch in enumerate((padded, padded) if aux else (padded, qwen3_vl_packed_batch(base))):
        opt.zero_grad()
        ref_opt.zero_grad()
        inputs = _inputs(batch)
        ids, labels = inputs.pop("input_ids"), inputs.pop("labels")
        loss = model.forward_backward(ids, labels, num_microbatches=microbatches, aux_loss=aux,
                                      schedule="gpipe" if aux else "1f1b", **inputs)
        ref_loss = _packed_reference(hf, batch)[1] if "cu_seqlens" in batch else hf(**_inputs(batch)).loss
        ref_loss.backward()
        kind = "packed" if "cu_seqlens" in batch else "padded"
        records.append((*tag, f"step{step}_loss_{kind}", _max_diff(loss, ref_loss)))
        records += [(*tag, f"grads_{part}_step{step}_{kind}", value)
                    for part, value in _grad_diffs(model, hf).items()]
        opt.step()
        ref_opt.step()
    return records


def suite(dirs: dict[str, str], layouts: list[tuple]) -> list[tuple]:
    records = []
    for case, kwargs, *options in layouts:
        options = options[0] if options else {}
        if options.get("bf16"):
            records += bf16_parity(case, dirs[case], ParallelConfig(**kwargs), moe=True, base=BASE[case])
        elif options.get("forward_backward"):
            records += training_parity(case, dirs[case], ParallelConfig(**kwargs),
                                       microbatches=options.get("microbatches", 2), aux=options.get("aux", False))
        else:
            records += parity(case, dirs[case], ParallelConfig(**kwargs), save=options.get("save", False))
    return records
