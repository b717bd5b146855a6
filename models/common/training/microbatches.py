"""A batch as samples with transformers' targets, and samples packed into one micro-batch.

``to_samples`` turns a padded ``[b, s]`` batch (optional attention mask) or packed tokens with
``cu_seqlens`` into per-sample tokens, positions and HF-shifted targets; ``pack`` concatenates the
samples of one micro-batch (chosen by ``parallel.microbatch.plan_microbatches``) into fixed-size
``[1, total]`` tensors with ``cu_seqlens``; ``merge_sample_inputs`` merges their per-sample model
inputs (Qwen2-VL's pixels and grids). Used by ``forward_backward.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class Sample:
    ids: torch.Tensor  # [n]
    positions: torch.Tensor  # [n], or [3, n] for M-RoPE
    targets: torch.Tensor  # [n], target of token t (HF-shifted), -100 = ignored
    inputs: dict | None = None  # per-sample model inputs merged per micro-batch (Qwen2-VL: pixels, grids)


def to_samples(input_ids: torch.Tensor, labels: torch.Tensor | None, attention_mask: torch.Tensor | None,
               cu_seqlens: torch.Tensor | None, position_ids: torch.Tensor | None = None) -> list[Sample]:
    """Per-sample tokens, positions and targets with transformers' semantics.

    Padded rows: positions are the row's ``0..s-1`` (as transformers uses them, also with left
    padding), targets are the row's labels shifted by one; only tokens with mask 1 are kept.
    Packed: each ``cu_seqlens`` segment is a sample with positions ``0..n-1``.
    """
    samples = []
    if cu_seqlens is not None:
        flat = input_ids.reshape(-1)
        lab = labels.reshape(-1) if labels is not None else torch.full_like(flat, IGNORE_INDEX)
        bounds = cu_seqlens.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            targets = torch.full((b - a,), IGNORE_INDEX, dtype=torch.long)
            targets[:-1] = lab[a + 1:b]
            if position_ids is None:
                pos = torch.arange(b - a)
            else:  # [T] / [1, T], or M-RoPE rows [3, 1, T]
                pos = position_ids.reshape(3, -1)[:, a:b] if position_ids.dim() == 3 else position_ids.reshape(-1)[a:b]
            samples.append(Sample(flat[a:b], pos, targets))
        return samples
    bsz, seq = input_ids.shape
    for r in range(bsz):
        targets = torch.full((seq,), IGNORE_INDEX, dtype=torch.long)
        if labels is not None:
            targets[:-1] = labels[r, 1:]
        keep = attention_mask[r].bool() if attention_mask is not None else torch.ones(seq, dtype=torch.bool)
        pos = position_ids[..., r, :] if position_ids is not None else torch.arange(seq)  # [s] or [3, s]
        samples.append(Sample(input_ids[r][keep], pos[..., keep], targets[keep]))
    return samples


def pack(samples: list[Sample], total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids/positions/targets ``[1, total]`` (M-RoPE positions ``[3, 1, total]``) and ``cu_seqlens``; the tail
    padding is one extra ignored sequence."""
    used = sum(len(s.ids) for s in samples)
    pad = total - used
    ids = torch.cat([s.ids for s in samples] + [torch.zeros(pad, dtype=torch.long)]).reshape(1, -1)
    rows = samples[0].positions.shape[:-1]  # () or (3,) for M-RoPE
    pos = torch.cat([s.positions for s in samples] + [torch.zeros(*rows, pad, dtype=torch.long)], dim=-1)
    pos = pos.reshape(*rows, 1, -1)
    tgt = torch.cat([s.targets for s in samples] + [torch.full((pad,), IGNORE_INDEX, dtype=torch.long)]).reshape(1, -1)
    lengths = [len(s.ids) for s in samples] + ([pad] if pad else [])
    cu = torch.tensor([0] + lengths).cumsum(0)
    return ids, pos, tgt, cu


def merge_sample_inputs(per_sample: list[dict | None]) -> dict | None:
    """One micro-batch's model inputs from its samples' (in packing order): each tensor concatenated
    along dim 0, keys whose every value is None dropped; None when no sample has any."""
    present = [d for d in per_sample if d]
    if not present:
        return None
    keys = sorted({k for d in present for k, v in d.items() if v is not None})
    return {k: torch.cat([d[k] for d in present if d.get(k) is not None]) for k in keys}
