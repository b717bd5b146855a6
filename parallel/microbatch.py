"""Splitting a batch of variable-length samples into balanced micro-batches (pure, no collectives).

``plan_microbatches`` picks the micro-batch count (enough for the token budget, at least the
requested count, rounded up to what the pipeline schedule needs), partitions the samples with the
Karmarkar-Karp largest-differencing method so token counts are balanced, and orders the
micro-batches by workload (sum of seq_len^2, attention's cost), heaviest first. Results computed
per micro-batch are put back in the original sample order with ``restore_order``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence, TypeVar

T = TypeVar("T")


class MicrobatchError(ValueError):
    """A batch that cannot be split as asked (numbers named)."""


def karmarkar_karp(weights: Sequence[int], k: int) -> list[list[int]]:
    """Indices of ``weights`` split into ``k`` groups with near-equal sums (largest differencing).

    Each item starts as a k-way partial partition; the two partitions with the largest spread are
    merged repeatedly, pairing the heaviest subset of one with the lightest of the other.
    """
    if k < 1:
        raise MicrobatchError(f"need at least one group, got k={k}")
    if len(weights) < k:
        raise MicrobatchError(f"cannot split {len(weights)} samples into {k} non-empty micro-batches")
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for idx, w in enumerate(weights):
        subsets = [(int(w), [idx])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-int(w), idx, subsets))
    counter = len(weights)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, la + lb) for (sa, la), (sb, lb) in zip(a, reversed(b))]
        merged.sort(key=lambda s: (-s[0], s[1]))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    return [sorted(indices) for _, indices in heap[0][2]]


@dataclass(frozen=True)
class MicrobatchPlan:
    """``groups[m]`` = sample indices of micro-batch m (in execution order)."""

    groups: tuple[tuple[int, ...], ...]
    tokens: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.groups)

    def restore_order(self, per_microbatch: Sequence[Sequence[T]]) -> list[T]:
        """Per-sample results given per micro-batch (same order as ``groups``) -> original order."""
        out: list = [None] * sum(len(g) for g in self.groups)
        for group, results in zip(self.groups, per_microbatch):
            if len(results) != len(group):
                raise MicrobatchError(f"micro-batch of {len(group)} samples returned {len(results)} results")
            for idx, r in zip(group, results):
                out[idx] = r
        return out


def plan_microbatches(seq_lens: Sequence[int], *, max_tokens_per_microbatch: int | None = None,
                      num_microbatches: int = 1, multiple_of: int = 1) -> MicrobatchPlan:
    """Balanced micro-batches of the samples with lengths ``seq_lens``.

    Count = max(num_microbatches, ceil(total / budget)), rounded up to ``multiple_of``, increased
    (by ``multiple_of``) until every micro-batch fits the budget. MicrobatchError when a sample is
    longer than the budget or there are fewer samples than micro-batches needed.
    """
    n = len(seq_lens)
    total = sum(seq_lens)
    if n == 0:
        raise MicrobatchError("empty batch")
    if num_microbatches < 1 or multiple_of < 1:
        raise MicrobatchError(f"num_microbatches={num_microbatches} and multiple_of={multiple_of} must be positive")
    if max_tokens_per_microbatch is not None:
        longest = max(seq_lens)
        if longest > max_tokens_per_microbatch:
            raise MicrobatchError(f"a sample of {longest} tokens exceeds max_tokens_per_microbatch="
                                  f"{max_tokens_per_microbatch}")
    k = max(num_microbatches, math.ceil(total / max_tokens_per_microbatch) if max_tokens_per_microbatch else 1)
    k = -(-k // multiple_of) * multiple_of
    while True:
        if k > n:
            raise MicrobatchError(f"{n} samples cannot fill {k} micro-batches (need a multiple of {multiple_of}, "
                                  f"at least {num_microbatches}, budget {max_tokens_per_microbatch} tokens)")
        groups = karmarkar_karp(seq_lens, k)
        sizes = [sum(seq_lens[i] for i in g) for g in groups]
        if max_tokens_per_microbatch is None or max(sizes) <= max_tokens_per_microbatch:
            break
        k += multiple_of
    order = sorted(range(k), key=lambda m: (-sum(seq_lens[i] ** 2 for i in groups[m]), groups[m]))
    return MicrobatchPlan(tuple(tuple(groups[m]) for m in order), tuple(sizes[m] for m in order))
