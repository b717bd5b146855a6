"""Rank bodies for the long-context tests: cp / ulysses / FSDP2 layouts against transformers on the
whole batch (gloo, CPU). Every rank builds the parallel model and a transformers model from the
same directory and returns measured differences; the parent asserts on them."""

from __future__ import annotations

import torch

from parallel import ParallelConfig
from tests.cases import build, load_hf
from tests.workers_pipeline import train_next_to_transformers

LENGTHS = [7, 1, 12, 5]  # packed: unequal, one of length 1, none a multiple of 2*cp


def _padded(vocab: int, length: int = 13):
    """3 rows of ``length`` (odd) with real lengths ``length``, 9 (right padding) and ``length - 4``
    (left padding)."""
    gen = torch.Generator().manual_seed(21)
    ids = torch.randint(0, vocab, (3, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, 4] = -100  # transformers would score it as predicted from a padding position
    labels[0, :2] = -100
    return ids, mask, labels


def _rel(ours: dict, ref: dict) -> float:
    return max(((g - ref[k].grad).abs().max() / ref[k].grad.abs().max().clamp(min=1e-12)).item()
               for k, g in ours.items())


def _grads(model) -> dict:
    return dict(model.iter_hf_weights({n: p.grad for n, p in model.named_parameters()}))


def model_call_checks(model, hf, tag) -> list[tuple]:
    """``model(...)``: padded and packed logits/loss, one backward + finalize_grads, pre-sliced input."""
    records = []
    vocab = hf.config.vocab_size
    # dynamic-NTK RoPE: longer than max_position_embeddings, so every rank must use the global length
    dynamic = (getattr(hf.config, "rope_parameters", None) or {}).get("rope_type") == "dynamic"
    ids, mask, labels = _padded(vocab, 2 * hf.config.max_position_embeddings + 1 if dynamic else 13)
    out = model(ids, attention_mask=mask, labels=labels, gather_logits=True)
    ref = hf(ids, attention_mask=mask, labels=labels)
    valid = mask.bool()
    records += [(*tag, "padded_logits", (out.logits[valid] - ref.logits[valid]).abs().max().item()),
                (*tag, "padded_loss", abs(out.loss.item() - ref.loss.item()))]
    if model.groups.sequence_split:  # padding is dropped before the layers: its logits are zeros
        records.append((*tag, "padding_logits_zero", out.logits[~valid].abs().max().item()))
    out.loss.backward()
    ref.loss.backward()
    model.finalize_grads()
    records.append((*tag, "model_call_grads", _rel(_grads(model), dict(hf.named_parameters()))))
    model.zero_grad()
    hf.zero_grad()
    if dynamic:  # transformers rescales per packed sequence (and caches the longest): no packed reference
        return records

    gen = torch.Generator().manual_seed(4)
    flat = torch.randint(0, vocab, (sum(LENGTHS),), generator=gen)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    with torch.no_grad():
        packed = model(flat, cu_seqlens=cu, labels=flat.clone(), gather_logits=True)
        refs = [hf(flat[a:b][None], labels=flat[a:b][None]) for a, b in bounds]
        ref_logits = torch.cat([r.logits[0] for r in refs])
        # token-mean over every sequence: HF's per-sequence means weighted by their target counts
        counts = torch.tensor([max(b - a - 1, 0) for a, b in bounds], dtype=torch.float64)
        ref_loss = sum(float(r.loss) * c for r, c in zip(refs, counts) if c > 0) / counts.sum()
    records += [(*tag, "packed_logits", (packed.logits[0] - ref_logits).abs().max().item()),
                (*tag, "packed_loss", abs(packed.loss.item() - float(ref_loss)))]

    # Already-sliced input: this rank feeds only its tokens, found from the lengths alone.
    plan = model.plan_sequences(LENGTHS)
    index = plan.token_index(*model.sequence_coordinates)
    target_index = plan.target_index(index)
    targets = torch.where(target_index >= 0, flat[target_index.clamp(min=0)], torch.full_like(index, -100))
    with torch.no_grad():
        local = model(flat[index.clamp(min=0)], sequence_plan=plan, targets=targets, gather_logits=True)
    real = index >= 0
    records += [(*tag, "presliced_logits", (local.logits[0][real] - ref_logits[index[real]]).abs().max().item()),
                (*tag, "presliced_loss", abs(local.loss.item() - float(ref_loss)))]
    return records


def training_checks(model, hf, tag) -> list[tuple]:
    """Two SGD steps of ``forward_backward`` and log-probs next to transformers (shared with the
    pipeline tests), then the weights exported after the steps (full HF tensors, also from FSDP2)."""
    records = train_next_to_transformers(model, hf, tag, num_microbatches=2)
    exported = dict(model.iter_hf_weights())
    ref_params = dict(hf.named_parameters())
    return records + [(*tag, "export_after_steps",
                       max((t - ref_params[k]).abs().max().item() for k, t in exported.items()))]


def long_context_suite(cases: list[tuple]) -> list[tuple]:
    """``cases``: (case name, model dir, ParallelConfig kwargs)."""
    records = []
    for case, path, kwargs in cases:
        config = ParallelConfig(**kwargs)
        tag = (case, config.describe())
        hf = load_hf(path)
        model = build(case, path, config)
        if config.pp == 1:
            records += model_call_checks(model, hf, tag)
        records += training_checks(model, hf, tag)
    return records


def bf16_suite(path: str, layouts: list[dict]) -> list[tuple]:
    """bf16 model under cp/ulysses against transformers in bf16 and fp32 on the same weights."""
    hf, exact_model = load_hf(path, dtype=torch.bfloat16), load_hf(path)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, hf.config.vocab_size, (2, 40), generator=gen)
    ref, exact = hf(ids, labels=ids), exact_model(ids, labels=ids)
    scale = exact.logits.abs().max().item()
    ref_error = (ref.logits.float() - exact.logits).abs().max().item()
    records = []
    for kwargs in layouts:
        model = build("qwen2", path, ParallelConfig(**kwargs), dtype=torch.bfloat16)
        out = model(ids, labels=ids, gather_logits=True)
        out.loss.backward()  # the bf16 backward kernels run (values checked in fp32 elsewhere)
        tag = ("qwen2_untied", ParallelConfig(**kwargs).describe())
        records += [(*tag, "bf16_logits_rel", (out.logits.float() - ref.logits.float()).abs().max().item() / scale),
                    (*tag, "bf16_loss", abs(out.loss.item() - ref.loss.item())),
                    (*tag, "bf16_vs_fp32_ratio", (out.logits.float() - exact.logits).abs().max().item() / ref_error)]
    return records
