"""Pure sharding rules: which part of a full tensor TP rank ``r`` of ``n`` holds, and how to merge back.

The single source of truth for "which rows/columns go where". Model loading (reading only a rank's
rows from safetensors), live weight export and offline checkpoint conversion all call these rules.

A rule answers ``piece(full_shape, rank, size)``: the dimension and the ``[start, stop)`` range of
the full tensor that rank holds (the range may run past the end for the padded vocabulary; the
excess is zero rows). ``split`` and the lazy safetensors reader both apply that same answer.

Rule kinds
  Replicated()              every rank holds the whole tensor (norm weights, row-parallel bias)
  Split(dim)                contiguous equal chunks along ``dim`` (column: dim 0, row: dim 1)
  KVHeads(head_dim, kv)     K or V projection rows: chunks of heads when kv % n == 0; when
                            n % kv == 0 each rank holds one head, head ``r // (n // kv)``
                            (replicated n/kv times, as vLLM's QKVParallelLinear does)
  Vocab(vocab, padded)      rows padded with zeros to ``padded`` rows, then equal chunks
  Fused(parts)              a tensor stacking ``parts`` equal blocks along dim 0 (Qwen2-VL's
                            vision ``attn.qkv`` = ``[q | k | v]`` in one HF tensor): each block
                            split like ``Split(0)``, rank r holding ``[q_r | k_r | v_r]``
  Blocks(sizes)             a tensor stacking blocks of unequal row counts along dim 0 (Gated
                            DeltaNet's ``in_proj_qkv`` and ``conv1d``: ``[q | k | v]`` with q, k of
                            Hk*dk rows and v of Hv*dv): each block split like ``Split(0)``, rank r
                            holding ``[q_r | k_r | v_r]`` (its rows are ``Piece.spans``)
  Groups(sizes, groups)     a tensor of ``groups`` equal row groups, each stacking components of
                            ``sizes`` rows (Qwen3-Next's interleaved ``in_proj_qkvz``: per key-head
                            group ``[q_g | k_g | v_g | z_g]``): rank r holds a contiguous run of
                            groups, de-interleaved component by component (``[q_r | k_r | v_r | z_r]``,
                            each in group order; its rows are ``Piece.spans``)
Packed tensors (``[q | k | v]``, ``[gate | up]``) are a concatenation along dim 0 of their parts'
shards, each part with its own rule: see ``Packed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:  # the rules are plain data; torch is imported where tensors are touched, so the
    import torch  # converters' copy path can read the weight map without loading torch


class ShardingError(ValueError):
    """A tensor that cannot be split or merged under a rule (sizes named in the message)."""


@dataclass(frozen=True)
class Piece:
    """The part of a full tensor one rank holds: rows/cols ``[start, stop)`` along ``dim``.

    ``dim`` None means the whole tensor. ``stop`` may exceed the tensor's length (padding rows).
    """

    dim: int | None
    start: int = 0
    stop: int = 0
    chunks: int = 1  # > 1: ``dim`` is ``chunks`` equal blocks, ``[start, stop)`` taken from each, concatenated
    # non-empty: the ``[start, stop)`` ranges of ``dim`` this piece holds, concatenated in order (unequal
    # blocks, ``Blocks``); ``start``/``stop`` are then 0 and the shard's row count
    spans: tuple[tuple[int, int], ...] = ()

    def ranges(self, length: int) -> list[tuple[int, int, int]]:
        """``(start, stop, offset)`` per contiguous range of the full tensor's ``dim`` (of ``length``)
        this piece holds, ``offset`` being where the range begins in the rank's shard: one range, or
        one per block when ``chunks > 1`` or ``spans`` are given. ``stop`` may run past ``length`` (padding rows)."""
        if self.spans:
            offsets = [0]
            for a, b in self.spans:
                offsets.append(offsets[-1] + b - a)
            return [(a, b, off) for (a, b), off in zip(self.spans, offsets)]
        if self.chunks == 1:
            return [(self.start, self.stop, 0)]
        per, width = length // self.chunks, self.stop - self.start
        return [(c * per + self.start, c * per + self.stop, c * width) for c in range(self.chunks)]


class Rule:
    """Base class: subclasses define ``piece`` and ``merge``."""

    def piece(self, full_shape: Sequence[int], rank: int, size: int) -> Piece:
        raise NotImplementedError

    def merge(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def shard_shape(self, full_shape: Sequence[int], size: int) -> tuple[int, ...]:
        """Shape of one rank's shard (equal on every rank for every rule here)."""
        p = self.piece(full_shape, 0, size)
        if p.dim is None:
            return tuple(full_shape)
        shape = list(full_shape)
        shape[p.dim] = p.stop - p.start
        return tuple(shape)

    def split(self, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank ``rank``'s shard of the full ``tensor`` (a new contiguous tensor)."""
        return read_piece(lambda idx: tensor[idx], tuple(tensor.shape), self.piece(tensor.shape, rank, size),
                          tensor.dtype)

    def split_all(self, tensor: torch.Tensor, size: int) -> list[torch.Tensor]:
        return [self.split(tensor, r, size) for r in range(size)]


def _check_rank(rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ShardingError(f"rank {rank} is out of range for a group of {size}")


def _even_chunk(length: int, rank: int, size: int, what: str) -> tuple[int, int]:
    _check_rank(rank, size)
    if length % size:
        raise ShardingError(f"{what}: size {length} is not divisible by {size} ranks")
    per = length // size
    return rank * per, (rank + 1) * per


@dataclass(frozen=True)
class Replicated(Rule):
    def piece(self, full_shape, rank, size):
        _check_rank(rank, size)
        return Piece(None)

    def merge(self, shards):
        return shards[0].clone()


@dataclass(frozen=True)
class Split(Rule):
    dim: int = 0

    def piece(self, full_shape, rank, size):
        if self.dim >= len(full_shape):
            # A 1-D bias of a row-parallel layer declared with dim=1 is not split.
            _check_rank(rank, size)
            return Piece(None)
        start, stop = _even_chunk(full_shape[self.dim], rank, size,
                                  f"split along dim {self.dim} of {tuple(full_shape)}")
        return Piece(self.dim, start, stop)

    def merge(self, shards):
        import torch

        if self.dim >= shards[0].dim():
            return shards[0].clone()
        return torch.cat(list(shards), dim=self.dim)


@dataclass(frozen=True)
class KVHeads(Rule):
    head_dim: int
    num_kv_heads: int

    def replicas(self, size: int) -> int:
        """How many ranks hold each KV head (1 when heads are split, tp/kv when replicated)."""
        if self.num_kv_heads % size == 0:
            return 1
        if size % self.num_kv_heads == 0:
            return size // self.num_kv_heads
        raise ShardingError(f"num_kv_heads={self.num_kv_heads} and tp={size}: one must divide the other")

    def piece(self, full_shape, rank, size):
        _check_rank(rank, size)
        if full_shape[0] != self.num_kv_heads * self.head_dim:
            raise ShardingError(
                f"KV projection has {full_shape[0]} rows, expected num_kv_heads*head_dim = "
                f"{self.num_kv_heads}*{self.head_dim}"
            )
        rep = self.replicas(size)
        if rep == 1:
            start, stop = _even_chunk(full_shape[0], rank, size, "KV heads")
            return Piece(0, start, stop)
        head = rank // rep
        return Piece(0, head * self.head_dim, (head + 1) * self.head_dim)

    def merge(self, shards):
        import torch

        rep = self.replicas(len(shards))
        return torch.cat([shards[i] for i in range(0, len(shards), rep)], dim=0)


@dataclass(frozen=True)
class Vocab(Rule):
    vocab_size: int
    padded_size: int

    def piece(self, full_shape, rank, size):
        if full_shape[0] != self.vocab_size:
            raise ShardingError(f"vocabulary tensor has {full_shape[0]} rows, expected vocab_size={self.vocab_size}")
        if self.padded_size < self.vocab_size:
            raise ShardingError(f"padded vocab {self.padded_size} is smaller than vocab_size={self.vocab_size}")
        start, stop = _even_chunk(self.padded_size, rank, size, "padded vocabulary")
        return Piece(0, start, stop)

    def shard_shape(self, full_shape, size):
        return (self.padded_size // size, *full_shape[1:])

    def merge(self, shards):
        import torch

        return torch.cat(list(shards), dim=0)[: self.vocab_size].clone()


@dataclass(frozen=True)
class Fused(Rule):
    parts: int

    def piece(self, full_shape, rank, size):
        if full_shape[0] % self.parts:
            raise ShardingError(f"fused tensor of {full_shape[0]} rows does not stack {self.parts} equal blocks")
        start, stop = _even_chunk(full_shape[0] // self.parts, rank, size,
                                  f"each of the {self.parts} blocks of {tuple(full_shape)}")
        return Piece(0, start, stop, chunks=self.parts)

    def shard_shape(self, full_shape, size):
        p = self.piece(full_shape, 0, size)
        return ((p.stop - p.start) * self.parts, *full_shape[1:])

    def merge(self, shards):
        import torch

        blocks = [s.reshape(self.parts, -1, *s.shape[1:]) for s in shards]  # [parts, rows_r, ...]
        merged = torch.cat(blocks, dim=1)
        return merged.reshape(-1, *shards[0].shape[1:])


@dataclass(frozen=True)
class Blocks(Rule):
    sizes: tuple[int, ...]

    def piece(self, full_shape, rank, size):
        if full_shape[0] != sum(self.sizes):
            raise ShardingError(f"tensor of {full_shape[0]} rows does not stack blocks of {list(self.sizes)} rows "
                                f"(sum {sum(self.sizes)})")
        spans, start = [], 0
        for rows in self.sizes:
            a, b = _even_chunk(rows, rank, size, f"each block of {list(self.sizes)} rows of {tuple(full_shape)}")
            spans.append((start + a, start + b))
            start += rows
        return Piece(0, 0, sum(b - a for a, b in spans), spans=tuple(spans))

    def merge(self, shards):
        import torch

        n = len(shards)
        parts = [s.split([rows // n for rows in self.sizes], dim=0) for s in shards]  # [rank][block]
        return torch.cat([parts[r][j] for j in range(len(self.sizes)) for r in range(n)], dim=0)


@dataclass(frozen=True)
class Groups(Rule):
    sizes: tuple[int, ...]
    groups: int

    def piece(self, full_shape, rank, size):
        width = sum(self.sizes)
        if full_shape[0] != self.groups * width:
            raise ShardingError(f"tensor of {full_shape[0]} rows is not {self.groups} groups of {list(self.sizes)} "
                                f"rows (expected {self.groups * width})")
        first, stop = _even_chunk(self.groups, rank, size, f"{self.groups} groups of {tuple(full_shape)}")
        spans, offset = [], 0
        for rows in self.sizes:  # component-major: all of this rank's q rows, then k, ...
            spans += [(g * width + offset, g * width + offset + rows) for g in range(first, stop)]
            offset += rows
        return Piece(0, 0, (stop - first) * width, spans=tuple(spans))

    def merge(self, shards):
        import torch

        per = self.groups // len(shards)
        out = []
        for shard in shards:  # [q_r | k_r | ...] -> [per, width, ...] group-major
            parts = shard.split([per * rows for rows in self.sizes], dim=0)
            out.append(torch.cat([p.reshape(per, rows, *shard.shape[1:]) for p, rows in zip(parts, self.sizes)],
                                 dim=1))
        return torch.cat(out, dim=0).reshape(-1, *shards[0].shape[1:])


def read_piece(
    read: Callable[[tuple[slice, ...]], torch.Tensor],
    full_shape: tuple[int, ...],
    piece: Piece,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Materialize ``piece`` using ``read(index)`` (a tensor or a lazy safetensors slice).

    Rows past the end of the full tensor (vocabulary padding) come back as zeros.
    """
    import torch

    if piece.dim is None:
        part = _own(read(tuple(slice(None) for _ in full_shape)))
        return part.to(dtype) if dtype is not None else part
    if piece.spans:  # unequal blocks (Blocks): each range, concatenated
        parts = []
        for a, b in piece.spans:
            index = [slice(None)] * len(full_shape)
            index[piece.dim] = slice(a, b)
            parts.append(_own(read(tuple(index))))
        part = torch.cat(parts, dim=piece.dim)
        return part.to(dtype) if dtype is not None and part.dtype != dtype else part
    if piece.chunks > 1:  # one range per block, concatenated (Fused)
        per = full_shape[piece.dim] // piece.chunks
        parts = []
        for c in range(piece.chunks):
            index = [slice(None)] * len(full_shape)
            index[piece.dim] = slice(c * per + piece.start, c * per + piece.stop)
            parts.append(_own(read(tuple(index))))
        part = torch.cat(parts, dim=piece.dim)
        return part.to(dtype) if dtype is not None and part.dtype != dtype else part
    length = full_shape[piece.dim]
    stop = min(piece.stop, length)
    index = [slice(None)] * len(full_shape)
    index[piece.dim] = slice(min(piece.start, length), stop)
    part = _own(read(tuple(index)))
    missing = piece.stop - max(stop, piece.start)
    if missing > 0:
        pad_shape = list(part.shape)
        pad_shape[piece.dim] = missing
        part = torch.cat([part, torch.zeros(pad_shape, dtype=part.dtype, device=part.device)], dim=piece.dim)
    if dtype is not None and part.dtype != dtype:
        part = part.to(dtype)
    return part


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that owns its memory (never a view into the caller's full tensor)."""
    t = t.contiguous()
    return t.clone() if t._base is not None else t


@dataclass(frozen=True)
class Packed:
    """A parameter that concatenates, along dim 0, the shards of several full tensors.

    ``parts`` are ``(name, rule)``; rank r's packed shard is ``cat([rule_i.split(part_i, r, n)])``.
    Used for ``qkv_proj`` = ``[q_r | k_r | v_r]`` and ``gate_up_proj`` = ``[gate_r | up_r]``.
    """

    parts: tuple[tuple[str, Rule], ...]

    def pack(self, tensors: Sequence[torch.Tensor], rank: int, size: int) -> torch.Tensor:
        import torch

        return torch.cat([rule.split(t, rank, size) for (_, rule), t in zip(self.parts, tensors)], dim=0)

    def unpack(self, shard: torch.Tensor, full_shapes: Sequence[Sequence[int]], size: int) -> list[torch.Tensor]:
        """Split one rank's packed shard back into its per-part shards."""
        sizes = [rule.shard_shape(shape, size)[0] for (_, rule), shape in zip(self.parts, full_shapes)]
        if sum(sizes) != shard.shape[0]:
            raise ShardingError(f"packed shard has {shard.shape[0]} rows, parts need {sizes} (sum {sum(sizes)})")
        return list(shard.split(sizes, dim=0))

    def merge(self, shards: Sequence[torch.Tensor], full_shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Full part tensors from every rank's packed shard."""
        per_rank = [self.unpack(s, full_shapes, len(shards)) for s in shards]
        return [rule.merge([pr[i] for pr in per_rank]) for i, (_, rule) in enumerate(self.parts)]
