"""Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``) and Qwen3-Next (``Qwen3NextForCausalLM``) rank bodies: our model
against transformers loaded from the same directory in the same process, fp32. Records are
``(case, layout, metric, value)``; tests/test_qwen3_next.py holds the bounds.

  * padded batch (a full row, a right-padded and a left-padded row) with ``output_router_logits``: logits
    on real tokens, the loss with ``router_aux_loss_coef`` times the load-balancing loss, the aux loss
    itself (padding excluded, as transformers does), gradients of every HF tensor (per-expert names);
  * packed batch (``cu_seqlens``; lengths 5, 1, 20, 3, 37) against each sequence run alone in
    transformers: logits, the token-mean loss and its gradients (no aux loss: transformers' is per call);
  * ``save_pretrained`` against the source checkpoint, bitwise (Qwen3-Next's interleaved projections
    written back interleaved);
  * a second step: both models take an SGD step on the packed batch's gradients, then the padded batch
    again (loss with the aux loss, every gradient) at the new weights.

Pipeline layouts (``pipeline_case``): two SGD steps of ``forward_backward`` with the load-balancing loss
(per micro-batch, as transformers computes it on each micro-batch alone) next to transformers, then
forward-only log-probs. LoRA (``lora_case``): the shared LoRA harness (tests/workers_lora.py) against peft.

Every rank gets the same batch, so under EP (carved from the data-parallel ranks) one transformers model
is the reference.
"""

from __future__ import annotations

import importlib

import torch

from parallel import ParallelConfig
from tests.workers import _max_diff, _rel_diff, hf_named_grads, saved_tensors_diff
from tests.workers_moe import hf_grads
from tests.workers_qwen3_5 import _padded_batch
from tests.workers_qwen3_5_layouts import LR

PACKED_LENGTHS = (5, 1, 20, 3, 37)
PADDED_LENGTH = 40
FOLDERS = {"qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next"}


def configs() -> dict:
    from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig

    lin, full = "linear_attention", "full_attention"
    common = dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, layer_types=[lin, lin, full, lin], max_position_embeddings=128,
                  moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts_per_tok=2,
                  router_aux_loss_coef=0.1, tie_word_embeddings=False)
    return {
        # every layer sparse (Qwen3.5-MoE has no dense MLP), 8 experts, renormalised top-2; value heads 4 on 2
        # key heads, dv != dk
        "qwen3_5_moe": Qwen3_5MoeTextConfig(**common, num_experts=8, linear_num_key_heads=2,
                                            linear_num_value_heads=4, linear_key_head_dim=16,
                                            linear_value_head_dim=24),
        # 4 key-head groups (2 per TP2 rank: the interleaved projections de-interleaved across groups), value
        # heads 2 per group, 4 experts top-2 not renormalised, layer 1 dense (mlp_only_layers)
        "qwen3_next": Qwen3NextConfig(**common, num_experts=4, norm_topk_prob=False, mlp_only_layers=[1],
                                      intermediate_size=96, linear_num_key_heads=4, linear_num_value_heads=8,
                                      linear_key_head_dim=16, linear_value_head_dim=16),
    }


def _grad_rel(model, hf) -> float:
    """Largest relative gradient difference over every HF tensor this rank's stage holds (all of them
    without PP; inf when a name is missing or foreign)."""
    ours, ref = hf_named_grads(model), hf_grads(hf)
    expected = set(ref) - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set())
    if not ours or not set(ours) <= expected or (model.groups.pp_size == 1 and set(ours) != expected):
        return float("inf")
    return max(_rel_diff(g, ref[n]) for n, g in ours.items() if g.numel())


def build(path: str, pconfig: ParallelConfig, **kw):
    """transformers' model of ``path`` and ours (the module of its ``model_type``)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    name = FOLDERS[hf.config.model_type]
    return name, hf, importlib.import_module(f"models.{name}").build_parallel_model(path, pconfig, **kw)


def case(path: str, pconfig: ParallelConfig) -> list[tuple]:
    name, hf, model = build(path, pconfig)
    layout = pconfig.describe()
    records = []

    def rec(metric, value):
        records.append((name, layout, metric, value))

    ids, mask, labels = _padded_batch(hf.config.vocab_size, PADDED_LENGTH, right=30, left=12)
    out = model(ids, attention_mask=mask, labels=labels, gather_logits=True, output_router_logits=True)
    ref = hf(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    real = mask.bool()
    rec("padded_logits", _max_diff(out.logits[real], ref.logits[real]))
    rec("padded_loss", _max_diff(out.loss, ref.loss))
    rec("padded_aux_loss", _max_diff(out.aux_loss, ref.aux_loss))
    rec("aux_loss_value", ref.aux_loss.item())
    rec("router_layers", float(len(out.router_logits) != len(ref.router_logits)))
    model.zero_grad()
    hf.zero_grad()
    model(ids, attention_mask=mask, labels=labels, return_logits=False, output_router_logits=True).loss.backward()
    model.finalize_grads()
    ref.loss.backward()
    rec("padded_grads", _grad_rel(model, hf))

    gen = torch.Generator().manual_seed(12)
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen) for n in PACKED_LENGTHS]
    flat = torch.cat(seqs)
    cu = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()])
    out = model(flat, cu_seqlens=cu, labels=flat.clone(), gather_logits=True, output_router_logits=False)
    count = sum(n - 1 for n in PACKED_LENGTHS)
    hf.zero_grad()
    ref_logits, ref_loss = [], 0.0
    for s in seqs:
        r = hf(input_ids=s[None], labels=s[None] if len(s) > 1 else None, output_router_logits=False)
        ref_logits.append(r.logits[0])
        if len(s) > 1:  # transformers' loss is this sequence's token mean: weight it by its tokens
            ref_loss = ref_loss + r.loss * (len(s) - 1) / count
    rec("packed_logits", _max_diff(out.logits[0], torch.cat(ref_logits)))
    rec("packed_loss", _max_diff(out.loss, ref_loss))
    rec("packed_loss_value", out.loss.item())
    model.zero_grad()
    model(flat, cu_seqlens=cu, labels=flat.clone(), return_logits=False, output_router_logits=False).loss.backward()
    model.finalize_grads()
    ref_loss.backward()
    rec("packed_grads", _grad_rel(model, hf))
    rec("saved_tensors", saved_tensors_diff(model, path, pconfig))

    # step 1: both take an SGD step on the packed batch's gradients, then the padded batch at the new weights
    torch.optim.SGD(model.parameters(), lr=LR).step()
    torch.optim.SGD(hf.parameters(), lr=LR).step()
    model.zero_grad()
    hf.zero_grad()
    loss = model(ids, attention_mask=mask, labels=labels, return_logits=False, output_router_logits=True).loss
    loss.backward()
    model.finalize_grads()
    ref = hf(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    ref.loss.backward()
    rec("step1_loss", _max_diff(loss, ref.loss))
    rec("step1_grads", _grad_rel(model, hf))
    return records


def _pipeline_batch(vocab: int):
    """Two rows of 23 tokens, the second right-padded from 15 (padding outside the aux-loss statistics)."""
    gen = torch.Generator().manual_seed(21)
    ids = torch.randint(0, vocab, (2, 23), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :2] = -100
    return ids, mask, labels


def _reference_loss(hf, ids, mask, labels):
    """transformers' value of ``forward_backward(..., num_microbatches=2, aux_loss=True)`` on the two rows:
    the token-mean cross entropy of the whole batch plus the coefficient times the mean over the two
    micro-batches (one row each) of each one's load-balancing loss."""
    ce = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
    aux = sum(hf(input_ids=ids[r:r + 1], attention_mask=mask[r:r + 1], output_router_logits=True).aux_loss
              for r in range(2)) / 2
    return ce + hf.config.router_aux_loss_coef * aux, aux


def pipeline_case(path: str, kwargs: dict, schedule: str, steps: int = 2) -> list[tuple]:
    """``forward_backward`` (two micro-batches, the aux loss) over the pipeline stages: SGD steps next to
    transformers (loss, aux loss, this stage's gradients), then forward-only log-probs."""
    from tests.workers_pipeline import ref_logprobs

    pconfig = ParallelConfig(**kwargs)
    name, hf, model = build(path, pconfig)
    tag = (name, f"{pconfig.describe()} {schedule}")
    ids, mask, labels = _pipeline_batch(hf.config.vocab_size)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(hf.parameters(), lr=LR)
    records = []
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss, aux = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2, schedule=schedule,
                                           aux_loss=True, return_aux_loss=True)
        ref_loss, ref_aux = _reference_loss(hf, ids, mask, labels)
        ref_loss.backward()
        records += [(*tag, f"pp_loss_step{step}", _max_diff(loss, ref_loss)),
                    (*tag, f"pp_aux_loss_step{step}", _max_diff(aux, ref_aux)),
                    (*tag, f"pp_grads_step{step}", _grad_rel(model, hf))]
        opt.step()
        ref_opt.step()
    lp = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2, schedule=schedule,
                                forward_only=True)
    with torch.no_grad():
        ref_lp = ref_logprobs(hf(input_ids=ids, attention_mask=mask).logits, labels)
    return records + [(*tag, "pp_logprobs", _max_diff(lp, ref_lp))]


def lora_case(path: str, adapter: str, out_dir: str, kwargs: dict) -> list[tuple]:
    """tests/workers_lora.lora_case (logits and LoRA gradients against peft, the saved adapter in peft, the
    merge against peft's) with this model's builder."""
    from transformers import AutoConfig

    from tests import workers_lora

    name = FOLDERS[AutoConfig.from_pretrained(path).model_type]
    original = workers_lora.build
    workers_lora.build = lambda case, source, pconfig, **kw: build(source, pconfig, **kw)[2]
    try:
        records = workers_lora.lora_case(name, path, adapter, out_dir, kwargs)
    finally:
        workers_lora.build = original
    return [(r[0], f"{r[1]} lora", r[3], r[4]) for r in records]


def suite(dirs: dict[str, str], plan: list[tuple[str, dict]], pipelines: list[tuple[str, dict, str]] = (),
          loras: list[tuple[str, str, dict]] = ()) -> list[tuple]:
    """``plan``: ``(model, ParallelConfig kwargs)`` items; ``pipelines``: ``(model, kwargs, schedule)``;
    ``loras``: ``(model, adapter dir, kwargs)``; every rank running each."""
    records = [r for name, kwargs in plan for r in case(dirs[name], ParallelConfig(**kwargs))]
    records += [r for name, kwargs, schedule in pipelines for r in pipeline_case(dirs[name], kwargs, schedule)]
    for i, (name, adapter, kwargs) in enumerate(loras):
        records += lora_case(dirs[name], adapter, f"{adapter}_out{i}", kwargs)
    return records
