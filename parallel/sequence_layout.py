"""Which tokens of a packed batch each context-parallel / Ulysses rank holds (pure, no collectives).

Context parallelism (CP) splits every sequence into ``2 * cp`` contiguous chunks and gives rank
``r`` chunks ``r`` and ``2*cp - 1 - r``: under a causal mask the early chunk has little to attend to
and the late one a lot, so every rank gets the same attention work (Megatron's load balancing).

Unlike Megatron, sequences are **not padded** to a multiple of ``2 * cp``. A sequence of length
``n`` gets chunks of ``n // (2*cp)`` tokens, and its ``n % (2*cp)`` leftover tokens go one per chunk
to ranks chosen round-robin, the turn carried over from one sequence to the next. Every rank then
holds ``ceil(real_tokens / cp)`` or one token fewer (Megatron's THD layout pads each sequence by
up to ``2*cp - 1`` tokens instead). Chunk sizes may differ by one token inside a sequence; the
attention masks below only rely on chunks being contiguous and in order, never on equal sizes.

A rank's local token order is, sequence by sequence, its early chunk then its late chunk, then
padding (index -1) up to ``local_len`` - the same on every CP rank (so ring buffers and pipeline
stage shapes are fixed) and a multiple of ``ulysses * tp`` (Ulysses splits the local tokens into
equal contiguous slices; Megatron SP splits those further over TP).

``segments(q_rank, kv_rank)`` lists the blocks of attention between the local tokens of two CP
ranks: per sequence, chunk ``i`` of the queries sees chunk ``j`` of the keys fully when ``i > j``,
causally when ``i == j`` and not at all when ``i < j``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch


class SequenceLayoutError(ValueError):
    """A batch that cannot be laid out as asked (numbers named)."""


class Segment(NamedTuple):
    """A block of attention: local queries ``[q_start, q_start + q_len)`` against local keys
    ``[k_start, k_start + k_len)`` of the key-owning rank; ``causal``: top-left aligned causal
    mask (only for a chunk against itself, so ``q_len == k_len``), else every key is visible."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    causal: bool


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class SequencePlan:
    """The split of one packed batch (sequences of ``lengths`` in order, then tail padding up to
    ``total`` tokens) over ``cp`` context-parallel ranks, each further split over ``ulysses`` ranks.

    Build it with ``plan_sequences``; every rank computes the same plan from the sequence lengths
    alone (no tokens needed), so a caller can fetch just its own tokens (``token_index``).
    """

    lengths: tuple[int, ...]
    total: int
    cp: int
    ulysses: int
    multiple: int
    local_len: int
    chunk_sizes: tuple[tuple[int, ...], ...]  # [sequence][chunk 0 .. 2cp-1]
    starts: tuple[int, ...] = field(repr=False)  # first global token of each sequence
    _memo: dict = field(default_factory=dict, repr=False, compare=False)  # memo: segments, rank indices

    # ------------------------------------------------------------------ per CP rank
    def chunk_range(self, seq: int, chunk: int) -> tuple[int, int]:
        """Global token range ``[a, b)`` of chunk ``chunk`` of sequence ``seq``."""
        sizes = self.chunk_sizes[seq]
        a = self.starts[seq] + sum(sizes[:chunk])
        return a, a + sizes[chunk]

    def _rank_chunks(self, seq: int, rank: int) -> tuple[int, int]:
        sizes = self.chunk_sizes[seq]
        return sizes[rank], sizes[2 * self.cp - 1 - rank]

    def cp_index(self, cp_rank: int) -> torch.Tensor:
        """Global flat token index of each of CP rank ``cp_rank``'s ``local_len`` tokens (-1 = padding);
        computed once per rank (taking tokens and restoring outputs ask again every forward)."""
        self._check_rank(cp_rank, self.cp, "cp")
        key = ("index", cp_rank)
        if key not in self._memo:
            self._memo[key] = self._compute_cp_index(cp_rank)
        return self._memo[key]

    def _compute_cp_index(self, cp_rank: int) -> torch.Tensor:
        parts = []
        for i in range(len(self.lengths)):
            for chunk in (cp_rank, 2 * self.cp - 1 - cp_rank):
                a, b = self.chunk_range(i, chunk)
                if b > a:
                    parts.append(torch.arange(a, b))
        index = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
        return torch.cat([index, torch.full((self.local_len - index.numel(),), -1, dtype=torch.long)])

    def token_index(self, cp_rank: int, ulysses_rank: int = 0) -> torch.Tensor:
        """Global flat token index of the ``local_len / ulysses`` tokens this (cp, ulysses) rank holds
        (-1 = padding): what a caller passing already-sliced inputs feeds this rank."""
        self._check_rank(ulysses_rank, self.ulysses, "ulysses")
        per = self.local_len // self.ulysses
        return self.cp_index(cp_rank)[ulysses_rank * per:(ulysses_rank + 1) * per]

    def target_index(self, index: torch.Tensor) -> torch.Tensor:
        """For tokens at global ``index``: the global index of the next token of the same sequence,
        -1 for each sequence's last token and for padding (the HF-shifted label position)."""
        if not self.lengths:
            return torch.full_like(index, -1)
        ends = torch.tensor(self.starts, dtype=torch.long) + torch.tensor(self.lengths, dtype=torch.long)
        seq = torch.searchsorted(torch.tensor(self.starts, dtype=torch.long), index, right=True) - 1
        nxt = index + 1
        valid = (index >= 0) & (seq >= 0)
        valid &= nxt < ends[seq.clamp(min=0)]
        return torch.where(valid, nxt, torch.full_like(index, -1))

    def positions(self, index: torch.Tensor) -> torch.Tensor:
        """Position of the tokens at global ``index`` within their sequence (0 for padding)."""
        starts = torch.tensor(self.starts, dtype=torch.long)
        seq = (torch.searchsorted(starts, index, right=True) - 1).clamp(min=0)
        return torch.where(index >= 0, index - starts[seq] if len(self.starts) else index, torch.zeros_like(index))

    def local_cu_seqlens(self, cp_rank: int) -> torch.Tensor:
        """cu_seqlens of CP rank ``cp_rank``'s local tokens read as whole sequences (cp == 1 only:
        then every sequence is local; the tail padding forms one more, ignored, sequence)."""
        if self.cp != 1:
            raise SequenceLayoutError("local_cu_seqlens describes whole sequences; with cp > 1 use segments()")
        lengths = [n for n in self.lengths if n]
        pad = self.local_len - sum(lengths)
        return torch.tensor([0] + lengths + ([pad] if pad else [])).cumsum(0)

    # ------------------------------------------------------------------ attention blocks
    def segments(self, q_rank: int, kv_rank: int) -> list[Segment]:
        """Attention blocks between CP rank ``q_rank``'s queries and ``kv_rank``'s keys (local offsets);
        computed once per pair (every layer's forward and backward asks again)."""
        key = (q_rank, kv_rank)
        if key not in self._memo:
            self._memo[key] = self._compute_segments(q_rank, kv_rank)
        return self._memo[key]

    def _compute_segments(self, q_rank: int, kv_rank: int) -> list[Segment]:
        cp = self.cp
        out: list[Segment] = []
        q_off = k_off = 0
        for i in range(len(self.lengths)):
            qa, qb = self._rank_chunks(i, q_rank)  # early, late chunk sizes of the query rank
            ka, kb = self._rank_chunks(i, kv_rank)
            if q_rank == kv_rank:
                blocks = [Segment(q_off, qa, k_off, ka, True), Segment(q_off + qa, qb, k_off, ka, False),
                          Segment(q_off + qa, qb, k_off + ka, kb, True)]
            elif kv_rank < q_rank:  # both query chunks come after the key rank's early chunk
                blocks = [Segment(q_off, qa + qb, k_off, ka, False)]
            else:  # only the query rank's late chunk comes after (both of) the key rank's chunks
                blocks = [Segment(q_off + qa, qb, k_off, ka + kb, False)]
            out += [s for s in blocks if s.q_len and s.k_len]
            q_off += qa + qb
            k_off += ka + kb
        assert q_off <= self.local_len and k_off <= self.local_len and cp >= 1
        return out

    # ------------------------------------------------------------------ back to the global order
    def restore(self, per_rank: torch.Tensor) -> torch.Tensor:
        """``per_rank [cp, local_len, ...]`` (every CP rank's local values, e.g. all-gathered) ->
        ``[total, ...]`` in global token order; positions no rank holds (tail padding) are 0."""
        if per_rank.shape[:2] != (self.cp, self.local_len):
            raise SequenceLayoutError(f"restore expects [cp={self.cp}, local_len={self.local_len}, ...], "
                                      f"got {tuple(per_rank.shape)}")
        index = torch.stack([self.cp_index(r) for r in range(self.cp)]).reshape(-1).to(per_rank.device)
        flat = per_rank.reshape(self.cp * self.local_len, *per_rank.shape[2:])
        keep = index >= 0
        out = flat.new_zeros((self.total, *per_rank.shape[2:]))
        out[index[keep]] = flat[keep]
        return out

    @staticmethod
    def _check_rank(rank: int, size: int, what: str) -> None:
        if not 0 <= rank < size:
            raise SequenceLayoutError(f"{what} rank {rank} is outside 0..{size - 1}")


def plan_sequences(lengths: Sequence[int], *, cp: int = 1, ulysses: int = 1, multiple: int = 1,
                   total: int | None = None) -> SequencePlan:
    """Lay out sequences of ``lengths`` (packed in order, then ``total - sum`` tail padding tokens)
    over ``cp`` context-parallel ranks and ``ulysses`` Ulysses ranks; ``multiple``: the local
    length per Ulysses rank must also divide by it (tp under Megatron SP).

    The local length is ``ceil(total / cp)`` rounded up to ``ulysses * multiple``, so it depends only
    on ``total`` (fixed shapes for every micro-batch of a step).
    """
    lengths = tuple(int(n) for n in lengths)
    if any(n < 0 for n in lengths):
        raise SequenceLayoutError(f"sequence lengths must be >= 0, got {list(lengths)}")
    for name, value in (("cp", cp), ("ulysses", ulysses), ("multiple", multiple)):
        if value < 1:
            raise SequenceLayoutError(f"{name}={value} must be positive")
    real = sum(lengths)
    total = real if total is None else int(total)
    if total < real:
        raise SequenceLayoutError(f"total={total} is smaller than the {real} tokens of the sequences")
    chunks = 2 * cp
    sizes: list[tuple[int, ...]] = []
    turn = 0  # the CP rank that gets the next leftover token
    for n in lengths:
        base, extra = divmod(n, chunks)
        row = [base] * chunks
        visits = [0] * cp
        for e in range(extra):
            r = (turn + e) % cp
            row[r if visits[r] == 0 else chunks - 1 - r] += 1
            visits[r] += 1
        turn = (turn + extra) % cp
        sizes.append(tuple(row))
    local_len = _round_up(max(math.ceil(total / cp), 1), ulysses * multiple)
    starts = tuple(itertools.accumulate(lengths[:-1], initial=0)) if lengths else ()
    return SequencePlan(lengths, total, cp, ulysses, multiple, local_len, tuple(sizes), starts)
