"""Qwen3.5 rank bodies under a sequence split (cp, Ulysses, both, and TP x CP): our model against
transformers' ``Qwen3_5ForCausalLM`` run on each sequence alone, fp32, with transformers in fp64 as the
truth. Records are ``(case, layout, metric, value)``; tests/test_qwen3_5_context.py holds the bounds.

Every rank loads transformers once and computes the references once (those of the second step too:
every layout starts from the same weights and, when exact, takes the same step); each layout then
builds our model on the same 4-rank world (dp fills what tp * cp * ulysses leaves) and runs:

  * for some layouts, the padded batch of tests/workers_qwen3_5.py (right and left padding);
  * a packed batch (lengths 5, 1, 20, 3, 70, 2, 37: chunks of 0-2 tokens, shorter than the conv
    kernel, on every rank, sequences and chunks crossing CP ranks): logits, loss, gradients of
    every HF tensor (after ``finalize_grads``);
  * an SGD step (lr ``LR``) on those gradients, then the packed batch again: loss and gradients.
"""

from __future__ import annotations

import torch

from parallel import ParallelConfig
from tests.workers import fp32_error_ratio
from tests.workers_qwen3_5 import _diff, _grad_rel, _padded_batch
from tests.workers_qwen3_5_layouts import LR

PACKED_LENGTHS = (5, 1, 20, 3, 70, 2, 37)
LAYOUTS = [  # (ParallelConfig kwargs, padded batch too)
    (dict(cp=2), True),
    (dict(cp=2, cp_comm="allgather"), False),
    (dict(ulysses=2), True),
    (dict(cp=2, ulysses=2), True),
    (dict(cp=2, ulysses=2, cp_comm="allgather"), False),
    (dict(tp=2, cp=2), True),
    (dict(tp=2, sequence_parallel=True, cp=2, cp_comm="allgather"), False),
    (dict(cp=4), True),  # 8 chunks of 18-19 tokens: the 70-token sequence over 5 of them
]


def _packed_references(hf, truth=None):
    gen = torch.Generator().manual_seed(12)
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen) for n in PACKED_LENGTHS]
    count = sum(n - 1 for n in PACKED_LENGTHS)
    hf.zero_grad()
    logits, exact, loss = [], [], 0.0
    for s in seqs:
        r = hf(input_ids=s[None], labels=s[None] if len(s) > 1 else None)
        logits.append(r.logits[0].detach())
        if truth is not None:
            with torch.no_grad():
                exact.append(truth(input_ids=s[None]).logits[0])
        if len(s) > 1:  # transformers' loss is this sequence's token mean: weight it by its tokens
            loss = loss + r.loss * (len(s) - 1) / count
    loss.backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    return torch.cat(seqs), torch.cat(logits), torch.cat(exact) if exact else None, loss.detach(), grads


def _padded_references(hf, truth):
    ids, mask, labels = _padded_batch(hf.config.vocab_size)
    hf.zero_grad()
    ref = hf(input_ids=ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    with torch.no_grad():
        exact = truth(input_ids=ids, attention_mask=mask, labels=labels).logits
    return (ids, mask, labels), ref.logits.detach(), exact, ref.loss.detach(), grads


def _with_grads(hf, grads):
    for n, p in hf.named_parameters():
        p.grad = grads[n]
    return hf


def suite(name: str, path: str) -> list[tuple]:
    from transformers import AutoModelForCausalLM

    from models.qwen3_5 import build_parallel_model

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    truth = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    (ids, mask, labels), d_logits, d_exact, d_loss, d_grads = _padded_references(hf, truth)
    flat, p_logits, p_exact, p_loss, p_grads = _packed_references(hf, truth)
    with torch.no_grad():  # the second step's reference: one SGD step on the packed gradients
        for n, p in hf.named_parameters():
            p -= LR * p_grads[n]
    _, _, _, s_loss, s_grads = _packed_references(hf)
    cu = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()])
    real = mask.bool()
    records = []
    for kwargs, padded in LAYOUTS:
        config = ParallelConfig(**kwargs)
        layout = config.describe()

        def rec(metric, value, layout=layout):
            records.append((name, layout, metric, value))

        model = build_parallel_model(path, config)
        if padded:
            out = model(ids, attention_mask=mask, labels=labels, gather_logits=True)
            rec("padded_logits", _diff(out.logits[real], d_logits[real]))
            rec("padded_logits_ratio", fp32_error_ratio(out.logits[real], d_logits[real], d_exact[real]))
            rec("padded_loss", _diff(out.loss, d_loss))
            model.zero_grad()
            out.loss.backward()
            model.finalize_grads()
            rec("padded_grads", _grad_rel(model, _with_grads(hf, d_grads)))
        out = model(flat, cu_seqlens=cu, labels=flat.clone(), gather_logits=True)
        rec("packed_logits", _diff(out.logits[0], p_logits))
        rec("packed_logits_ratio", fp32_error_ratio(out.logits[0], p_logits, p_exact))
        rec("packed_loss", _diff(out.loss, p_loss))
        rec("packed_loss_value", out.loss.item())
        model.zero_grad()
        out.loss.backward()
        model.finalize_grads()
        rec("packed_grads", _grad_rel(model, _with_grads(hf, p_grads)))
        torch.optim.SGD(model.parameters(), lr=LR).step()
        model.zero_grad()
        out = model(flat, cu_seqlens=cu, labels=flat.clone(), return_logits=False)
        out.loss.backward()
        model.finalize_grads()
        rec("step1_loss", _diff(out.loss, s_loss))
        rec("step1_grads", _grad_rel(model, _with_grads(hf, s_grads)))
    return records
