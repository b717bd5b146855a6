"""Rank bodies for the pipeline/DP tests: forward_backward against transformers on the full batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import ParallelConfig
from tests.cases import build, load_hf


def batch(vocab: int, seed: int = 0):
    """4 samples with padding (right and left) and some ignored labels: the global batch."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (4, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    mask[3, :3] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :2] = -100
    # With left padding transformers would also score the first real token as predicted from a pad
    # position (a meaningless term); forward_backward only scores predictions made by real tokens.
    labels[3, 3] = -100
    return ids, mask, labels


def ref_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers-side per-token log-prob of labels, aligned like forward_backward's output."""
    lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(labels.shape, dtype=torch.float32)
    out[:, 1:] = lp.masked_fill(labels[:, 1:] == -100, 0.0)
    return out


def _tied_copies_equal(model) -> float:
    """max |embedding - last stage head copy| (0 when not split over stages)."""
    groups = model.groups
    if not model.config.tie_word_embeddings or groups.pp_size == 1:
        return 0.0
    shape = (model.padded_vocab_size // groups.tp_size, model.config.hidden_size)
    first = model.model.embed_tokens.weight.detach().clone() if model.is_first_stage else torch.zeros(shape)
    dist.broadcast(first, src=dist.get_global_rank(groups.pp_group, 0), group=groups.pp_group)
    if model.is_last_stage:
        return (first - model.lm_head.weight.detach()).abs().max().item()
    return 0.0


def train_next_to_transformers(model, hf, tag: tuple, *, num_microbatches: int, schedule: str = "1f1b",
                               steps: int = 2, lr: float = 0.5) -> list[tuple]:
    """SGD steps of ``forward_backward`` next to transformers on the whole batch (loss and gradients
    per step), then forward-only log-probs; each DP rank takes its share of the 4-sample batch."""
    groups = model.groups
    ids, mask, labels = batch(hf.config.vocab_size)
    # Each DP rank takes its share of the global batch; transformers sees the whole batch.
    share = slice(groups.dp_rank * 4 // groups.dp_size, (groups.dp_rank + 1) * 4 // groups.dp_size)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(hf.parameters(), lr=lr)
    records = []
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model.forward_backward(ids[share], labels[share], attention_mask=mask[share],
                                      num_microbatches=num_microbatches, schedule=schedule)
        ref = hf(ids, attention_mask=mask, labels=labels)
        ref.loss.backward()
        records.append((*tag, f"loss_step{step}", abs(loss.item() - ref.loss.item())))
        ours = dict(model.iter_hf_weights({n: p.grad for n, p in model.named_parameters()}))
        ref_params = dict(hf.named_parameters())
        worst = max(((g - ref_params[k].grad).abs().max() / ref_params[k].grad.abs().max().clamp(min=1e-12)).item()
                    for k, g in ours.items())
        records.append((*tag, f"grads_step{step}", worst))
        opt.step()
        ref_opt.step()
    lp = model.forward_backward(ids[share], labels[share], attention_mask=mask[share],
                                num_microbatches=num_microbatches, schedule=schedule, forward_only=True)
    with torch.no_grad():
        ref_lp = ref_logprobs(hf(ids, attention_mask=mask).logits, labels)[share]
    records.append((*tag, "logprobs", (lp - ref_lp).abs().max().item()))
    return records


def pipeline_case(case: str, path: str, pconfig: ParallelConfig, schedule: str, num_microbatches: int) -> list[tuple]:
    model = build(case, path, pconfig)
    tag = (case, pconfig.describe(), f"dp={model.groups.dp_size}", schedule)
    records = train_next_to_transformers(model, load_hf(path), tag, num_microbatches=num_microbatches,
                                         schedule=schedule)
    return records + [(*tag, "tied_copies_differ", _tied_copies_equal(model))]


def pipeline_suite(cases: list[tuple]) -> list[tuple]:
    records = []
    for case, path, kwargs, schedule, nmb in cases:
        records += pipeline_case(case, path, ParallelConfig(**kwargs), schedule, nmb)
    return records
