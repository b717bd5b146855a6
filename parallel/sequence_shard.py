"""This rank's share of a sequence-split batch (context parallel and Ulysses) and the collectives over it.

A ``SequencePlan`` (``sequence_layout.py``) says which global tokens each (cp, ulysses) rank holds;
``SequenceShard`` is one rank's view of it with the groups attention needs (``context_attention.py``,
``ulysses.py``). ``plan_for``/``shard_of`` derive both from a job's ``ParallelGroups``;
``gather_tokens`` and ``sum_over_sequence_groups`` bring per-rank outputs back together. Nothing here
knows an architecture: the models' sequence-split forward and ``forward_backward`` use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from parallel.collectives import gather_for_replicas, group_size, reduce_from_group
from parallel.groups import ParallelGroups
from parallel.sequence_layout import SequencePlan, plan_sequences


@dataclass
class SequenceShard:
    """This rank's tokens of one packed batch and the groups that attention needs.

    ``index``: global flat token index of each local token (-1 = padding), ``plan.local_len /
    ulysses`` of them. ``rope_seq_len``: the whole batch's ``max(position) + 1`` (dynamic-NTK RoPE
    must see the global length, not the local one).
    """

    plan: SequencePlan
    index: torch.Tensor
    cp_group: Any
    ulysses_group: Any
    cp_comm: str
    rope_seq_len: int | None = None

    def take(self, values: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """This rank's rows of ``values [T, ...]`` (``fill`` at padding)."""
        index = self.index.to(values.device)
        if values.shape[0] == 0:  # nothing real in the batch: every local slot is padding
            return torch.full((index.numel(), *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
        picked = values[index.clamp(min=0)]
        pad = (index < 0).reshape(-1, *([1] * (values.dim() - 1)))
        return picked.masked_fill(pad, fill) if bool(pad.any()) else picked

    def local_cu_seqlens(self) -> torch.Tensor:
        """cp == 1: whole sequences are local; their cu_seqlens over the Ulysses-gathered tokens."""
        return self.plan.local_cu_seqlens(0).to(self.index.device)


def plan_for(groups: ParallelGroups, lengths: list[int], total: int | None = None) -> SequencePlan:
    """The plan of this job's layout for sequences of ``lengths`` (same on every rank)."""
    multiple = groups.tp_size if groups.sequence_parallel else 1
    return plan_sequences(lengths, cp=groups.cp_size, ulysses=groups.ulysses_size, multiple=multiple, total=total)


def shard_of(groups: ParallelGroups, plan: SequencePlan, rope_seq_len: int | None = None) -> SequenceShard:
    """This rank's ``SequenceShard`` of ``plan``."""
    if (plan.cp, plan.ulysses) != (groups.cp_size, groups.ulysses_size):
        raise ValueError(f"the sequence plan is for cp={plan.cp} ulysses={plan.ulysses}, the model runs "
                         f"cp={groups.cp_size} ulysses={groups.ulysses_size}")
    return SequenceShard(plan, plan.token_index(groups.cp_rank, groups.ulysses_rank), groups.cp_group,
                         groups.ulysses_group, groups.config.cp_comm, rope_seq_len)


def gather_tokens(local: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """Every rank's local rows ``[L/u, ...]`` -> ``[T, ...]`` in global token order, on every rank.

    Differentiable: the gradient of the result (identical on every rank) flows back to each
    rank's own rows.
    """
    x = gather_for_replicas(local.contiguous(), shard.ulysses_group)  # [L, ...] this CP rank's tokens
    x = gather_for_replicas(x, shard.cp_group)  # [cp * L, ...]
    plan = shard.plan
    return plan.restore(x.reshape(plan.cp, plan.local_len, *local.shape[1:]))


def sum_over_sequence_groups(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Sum a per-rank partial (e.g. of token losses) over the cp and ulysses ranks; the gradient
    each rank receives is that of its own part (identity backward)."""
    for group in (groups.cp_group, groups.ulysses_group):
        if group_size(group) > 1:
            x = reduce_from_group(x, group)
    return x
