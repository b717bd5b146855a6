"""Rank bodies for tests/test_fused_loss.py: the fused, chunked LM-head loss against transformers.

Every case runs a tiny Qwen2 whose vocabulary is not a multiple of TP (padding columns) with a
chunk size smaller than, and not dividing, the token count. Records are ``(layout, what, value)``;
the test compares each value with its tolerance.
"""

from __future__ import annotations

import torch

from parallel import ParallelConfig

CHUNK = 5  # tokens per chunk: below every token count here (39, 42 under SP, 19 packed, 18 per micro-batch)


def batch(vocab: int, seed: int = 0):
    """3 rows of 13 tokens, right and left padding and ignored labels (transformers semantics)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 13), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 2:5] = -100
    labels[2, 4] = -100  # the first real token of a left-padded row is predicted from padding
    return ids, mask, labels


def packed(vocab: int, lengths=(6, 9, 4), seed: int = 1):
    """Packed sequences (flat ids, cu_seqlens, labels with some ignored) and the same rows padded."""
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randint(0, vocab, (sum(lengths),), generator=gen)
    labels = flat.clone()
    labels[2] = -100
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    rows = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(rows)
    row_labels = torch.full_like(rows, -100)
    for r, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        rows[r, : b - a], mask[r, : b - a], row_labels[r, : b - a] = flat[a:b], 1, labels[a:b]
    return flat, cu, labels, rows, mask, row_labels


def grad_error(model, hf) -> float:
    """Worst relative gradient error over every HF tensor: max |ours - ref| / max |ref|."""
    ours = dict(model.iter_hf_weights({n: p.grad for n, p in model.named_parameters()}))
    ref = dict(hf.named_parameters())
    return max(((g - ref[k].grad).abs().max() / ref[k].grad.abs().max().clamp(min=1e-12)).item()
               for k, g in ours.items())


def grads_of(model) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient (this rank's shards)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def grads_error(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Worst relative difference between two gradient snapshots of the same model (same keys)."""
    assert ours.keys() == ref.keys() and ours
    return max(((g - ref[k]).abs().max() / ref[k].abs().max().clamp(min=1e-12)).item() for k, g in ours.items())


def reference_outputs(hf, ids, mask, labels):
    """Plain-torch log-probs and entropies from transformers' full logits, laid out like forward_backward's."""
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids, attention_mask=mask).logits.double(), -1)
    entropy = -(logp.exp() * logp).sum(-1)
    target = labels[:, 1:]
    lp = logp[:, :-1].gather(-1, target.clamp(min=0)[..., None])[..., 0].masked_fill(target == -100, 0.0)
    out_lp, out_ent = torch.zeros(ids.shape, dtype=torch.float64), torch.zeros(ids.shape, dtype=torch.float64)
    out_lp[:, 1:] = lp
    out_ent[:, 1:] = entropy[:, :-1] * mask[:, 1:] * mask[:, :-1]
    return out_lp, out_ent


def _zero(model, hf) -> None:
    for p in list(model.parameters()) + list(hf.parameters()):
        p.grad = None


def check_layout(path: str, pconfig: ParallelConfig, chunk: int = CHUNK) -> list[tuple]:
    """model(...) (pp=1: the default training call on a padded batch, explicit
    ``return_logits=False`` on a packed one) and forward_backward (training and forward-only with
    entropy) next to transformers on the same weights; the default's rule (pp=1): a model in
    training mode with labels returns no logits and the loss and gradients of the logits path
    (``return_logits=True``); ``gather_logits=True`` and eval mode return logits."""
    from models.qwen2 import build_parallel_model
    from tests.cases import load_hf

    model = build_parallel_model(path, pconfig, loss_chunk_tokens=chunk)
    hf = load_hf(path)
    vocab = hf.config.vocab_size
    tag = pconfig.describe()
    records = []
    ids, mask, labels = batch(vocab)
    if pconfig.pp == 1:
        assert model.training  # what build_parallel_model leaves it in
        _zero(model, hf)
        out = model(ids, attention_mask=mask, labels=labels)  # the default training call: the fused head
        loss = out.loss
        loss.backward()
        model.finalize_grads()
        ref = hf(ids, attention_mask=mask, labels=labels).loss
        ref.backward()
        records += [(tag, "forward_loss", abs(loss.item() - ref.item())), (tag, "forward_grads", grad_error(model, hf)),
                    (tag, "default_no_logits", float(out.logits is None))]
        fused = grads_of(model)
        _zero(model, hf)
        full = model(ids, attention_mask=mask, labels=labels, return_logits=True)  # logits asked for
        full.loss.backward()
        model.finalize_grads()
        records += [(tag, "logits_path_loss", abs(full.loss.item() - loss.item())),
                    (tag, "logits_path_grads", grads_error(fused, grads_of(model)))]
        with torch.no_grad():
            gathered = model(ids, attention_mask=mask, labels=labels, gather_logits=True)
            model.eval()
            evaluated = model(ids, attention_mask=mask, labels=labels)
            model.train()
        records += [(tag, "logits_on_request", float(full.logits is not None and gathered.logits is not None
                                                     and tuple(gathered.logits.shape) == (*ids.shape, vocab))),
                    (tag, "gathered_loss", abs(gathered.loss.item() - loss.item())),
                    (tag, "eval_logits", float(evaluated.logits is not None)),
                    (tag, "eval_loss", abs(evaluated.loss.item() - loss.item()))]
        # packed: transformers on the same sequences as padded rows gives the same token mean
        flat, cu, flat_labels, rows, row_mask, row_labels = packed(vocab)
        _zero(model, hf)
        loss = model(flat, cu_seqlens=cu, labels=flat_labels, return_logits=False).loss
        loss.backward()
        model.finalize_grads()
        ref = hf(rows, attention_mask=row_mask, labels=row_labels).loss
        ref.backward()
        records += [(tag, "packed_loss", abs(loss.item() - ref.item())), (tag, "packed_grads", grad_error(model, hf))]
    _zero(model, hf)
    loss = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2)
    ref = hf(ids, attention_mask=mask, labels=labels).loss
    ref.backward()
    records += [(tag, "step_loss", abs(loss.item() - ref.item())), (tag, "step_grads", grad_error(model, hf))]
    lp, ent = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2, forward_only=True,
                                     return_entropy=True)
    ref_lp, ref_ent = reference_outputs(hf, ids, mask, labels)
    plain = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2, forward_only=True)
    records += [(tag, "logprobs", (lp - ref_lp).abs().max().item()),
                (tag, "entropy", (ent - ref_ent).abs().max().item()),
                (tag, "logprobs_without_entropy", (plain - lp).abs().max().item()),
                (tag, "entropy_nonzero", float(ent.abs().sum() > 0))]
    return records


LAYOUTS_2 = [dict(tp=2, sequence_parallel=True), dict(cp=2, cp_comm="ring"), dict(ulysses=2), dict(pp=2),
             dict(tp=2)]


def two_rank_suite(paths: dict[str, str]) -> list[tuple]:
    records = []
    for name, path in paths.items():
        for kwargs in LAYOUTS_2:
            records += [(name, *r) for r in check_layout(path, ParallelConfig(**kwargs))]
    return records
