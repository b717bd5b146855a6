"""The context-parallel / Ulysses token layout: every token once, balanced, restorable, and the
attention blocks of every (query rank, key rank) pair covering exactly the causal same-sequence
mask (checked against a mask built from token positions, not from the plan's own arithmetic)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel.sequence_layout import SequenceLayoutError, plan_sequences

lengths_st = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=8)


def _seq_of(lengths):
    """Global token -> (sequence id, position in sequence), from the lengths alone."""
    seq, pos = [], []
    for i, n in enumerate(lengths):
        seq += [i] * n
        pos += list(range(n))
    return torch.tensor(seq, dtype=torch.long), torch.tensor(pos, dtype=torch.long)


@settings(max_examples=150, deadline=None)
@given(lengths_st, st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.integers(0, 9))
def test_every_token_once_balanced_and_restorable(lengths, cp, ulysses, multiple, tail):
    real = sum(lengths)
    plan = plan_sequences(lengths, cp=cp, ulysses=ulysses, multiple=multiple, total=real + tail)
    assert plan.local_len % (ulysses * multiple) == 0
    per_rank = [plan.cp_index(r) for r in range(cp)]
    held = torch.cat(per_rank)
    real_held = held[held >= 0]
    assert sorted(real_held.tolist()) == list(range(real))  # each real token exactly once
    counts = [int((ix >= 0).sum()) for ix in per_rank]
    assert max(counts) <= math.ceil(real / cp)
    assert max(counts) - min(counts) <= 1  # leftover tokens dealt round-robin across sequences
    for r, ix in enumerate(per_rank):  # real tokens first, padding after
        n = counts[r]
        assert bool((ix[:n] >= 0).all()) and bool((ix[n:] == -1).all())
        assert torch.equal(torch.cat([plan.token_index(r, u) for u in range(ulysses)]), ix)
    values = torch.arange(real + tail + 1, dtype=torch.float64) * 3 + 1  # one spare so padding can index
    gathered = torch.stack([torch.where(ix >= 0, values[ix.clamp(min=0)], torch.zeros(())) for ix in per_rank])
    restored = plan.restore(gathered)
    expect = values[:real + tail].clone()
    expect[real:] = 0
    assert torch.equal(restored, expect)


@settings(max_examples=150, deadline=None)
@given(lengths_st, st.integers(1, 4))
def test_chunks_are_contiguous_ordered_and_assigned_symmetrically(lengths, cp):
    plan = plan_sequences(lengths, cp=cp)
    for i, n in enumerate(lengths):
        start = plan.starts[i]
        bounds = [plan.chunk_range(i, c) for c in range(2 * cp)]
        assert bounds[0][0] == start and bounds[-1][1] == start + n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        sizes = [b - a for a, b in bounds]
        assert max(sizes) - min(sizes) <= 1
        for r in range(cp):  # rank r holds chunks r and 2cp-1-r of this sequence, in that order
            mine = set(plan.cp_index(r).tolist())
            for c in range(2 * cp):
                a, b = bounds[c]
                inside = all(t in mine for t in range(a, b))
                assert inside == (c in (r, 2 * cp - 1 - r)) or a == b


@settings(max_examples=120, deadline=None)
@given(lengths_st, st.integers(1, 4), st.integers(0, 5))
def test_segments_cover_exactly_the_causal_mask(lengths, cp, tail):
    real = sum(lengths)
    plan = plan_sequences(lengths, cp=cp, total=real + tail)
    seq, pos = _seq_of(lengths)
    expected = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])  # [query, key]
    covered = torch.zeros(real, real, dtype=torch.int64)
    index = [plan.cp_index(r) for r in range(cp)]
    for r in range(cp):
        for j in range(cp):
            for s in plan.segments(r, j):
                q = index[r][s.q_start:s.q_start + s.q_len]
                k = index[j][s.k_start:s.k_start + s.k_len]
                assert bool((q >= 0).all()) and bool((k >= 0).all())  # padding never attends
                block = torch.ones(s.q_len, s.k_len, dtype=torch.int64)
                if s.causal:
                    assert s.q_len == s.k_len
                    block = block.tril()
                covered[q[:, None], k[None, :]] += block
    assert torch.equal(covered, expected.long())  # every visible pair exactly once, nothing else


def test_causal_work_is_balanced_on_one_long_sequence():
    """The point of the 2*cp chunks: each rank's query-key pairs within 1% of an equal share."""
    for cp in (2, 4):
        plan = plan_sequences([4099], cp=cp)
        work = [sum(s.q_len * s.k_len / (2 if s.causal else 1) for j in range(cp) for s in plan.segments(r, j))
                for r in range(cp)]
        assert max(work) / min(work) < 1.01, work


def test_target_index_is_next_token_of_same_sequence():
    plan = plan_sequences([3, 0, 2], cp=2, total=7)
    index = torch.arange(-1, 7)
    assert plan.target_index(index).tolist() == [-1, 1, 2, -1, 4, -1, -1, -1]


@pytest.mark.parametrize("kwargs,match", [(dict(lengths=[3, -1]), "lengths"), (dict(lengths=[3], cp=0), "cp=0"),
                                          (dict(lengths=[5, 5], total=8), "total=8")])
def test_bad_layouts_are_refused(kwargs, match):
    lengths = kwargs.pop("lengths")
    with pytest.raises(SequenceLayoutError, match=match):
        plan_sequences(lengths, **kwargs)
