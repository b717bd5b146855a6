"""The copy path's operations: what produces each output tensor's bytes from the source files.

A Megatron -> HF conversion without a dtype change is a permutation of byte ranges: TP shards
that split rows (q/k/v, gate/up, embeddings) are contiguous ranges of the source files; shards that
split columns (``linear_proj``, ``linear_fc2``) are interleaved row by row. Every output tensor is a
list of ``Copy`` / ``Interleave`` / ``Zeros`` operations on the source files (``PlannedTensor``),
built from the blocks (``Block``) of the Megatron full tensor the source holds; which rows go where
comes from the architecture's weight map and ``converters/layout/megatron`` (the tables the torch
path uses too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from converters.formats.tensors import RawTensor
from converters.layout.hybrid import row_ranges
from converters.layout.megatron import (
    BLOCKS,
    COL1,
    GATE_UP,
    REPLICATED,
    ROW0,
    LayoutError,
    blocks_shard_rows,
    packed_components,
    tp_split_kind,
)
from models.common.errors import CheckpointError
from models.common.weight_map import GATE_UP_STACKED, MINUS_ONE, WeightEntry


class Unsupported(Exception):
    """The copy path cannot handle this checkpoint; the engine uses the torch path instead."""



@dataclass(frozen=True)
class Copy:
    """``n`` bytes at ``offset`` of ``path``, copied as they are."""

    path: str
    offset: int
    n: int

    @property
    def nbytes(self) -> int:
        return self.n


@dataclass(frozen=True)
class Interleave:
    """``rows`` rows, row r being the concatenation of row r of every part
    (``(path, offset, row_nbytes, stride)``: row r of a part is ``row_nbytes`` bytes at
    ``offset + r * stride`` of the source file; ``stride == row_nbytes`` for a contiguous block)."""

    rows: int
    parts: tuple[tuple[str, int, int, int], ...]

    @property
    def nbytes(self) -> int:
        return self.rows * sum(p[2] for p in self.parts)


@dataclass(frozen=True)
class Zeros:
    """``n`` zero bytes (Megatron's vocab padding): nothing is written, output files are created
    at their final size and read back as zeros where nothing was written."""

    n: int

    @property
    def nbytes(self) -> int:
        return self.n


@dataclass(frozen=True)
class Data:
    """Bytes computed while planning: a Gated DeltaNet output norm's ``minus_one`` values
    (``layout.megatron.shift_bytes``), one small vector per layer -- the only tensors that are not byte
    ranges of the source."""

    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class Transposed:
    """The transpose of the ``[rows, cols]`` row-major matrix of ``itemsize``-byte elements that ``ops``
    produce: ``cols`` rows of ``rows`` elements. A grouped-GEMM expert (``GroupedMLP``'s ``weight1`` /
    ``weight2`` hold each expert transposed) is not a byte range of a SequentialMLP or HF tensor; it is
    read into memory and transposed there (``copy_path.transpose``), a bounded block at a time: planners
    cut a big matrix into ops of a few column bands each (``megatron_moe.transposed_ops``)."""

    rows: int
    cols: int
    itemsize: int
    ops: tuple

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.itemsize


Op = Union[Copy, Interleave, Zeros, Data, Transposed]


@dataclass(frozen=True)
class Block:
    """A contiguous piece of a Megatron full tensor, seen as a matrix [rows, cols]: rows
    ``[r0, r0 + t.shape[0])`` and columns ``[c0, c0 + width)`` (1-D tensors: one column)."""

    r0: int
    c0: int
    t: RawTensor

    @property
    def width(self) -> int:
        return self.t.numel // self.t.shape[0] if self.t.shape and self.t.shape[0] else 1


def rows_ops(blocks: list[Block], shape: tuple[int, ...], a: int, b: int, what: str) -> list[Op]:
    """Operations producing rows ``[a, b)`` of the full tensor made of ``blocks``, in order."""
    cols = 1
    for d in shape[1:]:
        cols *= d
    cuts = sorted({a, b, *(x for blk in blocks for x in (blk.r0, blk.r0 + blk.t.shape[0]) if a < x < b)})
    ops: list[Op] = []
    for lo, hi in zip(cuts, cuts[1:]):
        band = sorted((blk for blk in blocks if blk.r0 <= lo and hi <= blk.r0 + blk.t.shape[0]), key=lambda x: x.c0)
        col = 0
        for blk in band:
            if blk.c0 != col:
                raise CheckpointError(f"{what}: stored pieces leave columns {col}..{blk.c0} of rows {lo}..{hi} "
                                      f"uncovered")
            col += blk.width
        if col != cols:
            raise CheckpointError(f"{what}: stored pieces cover {col} of {cols} columns of rows {lo}..{hi}")
        if len(band) == 1:
            t = band[0].t.rows(lo - band[0].r0, hi - band[0].r0)
            ops.append(Copy(t.path, t.offset, t.nbytes))
        else:
            parts = []
            for blk in band:
                t = blk.t.rows(lo - blk.r0, hi - blk.r0)
                parts.append((t.path, t.offset, t.row_nbytes, t.row_nbytes))
            ops.append(Interleave(hi - lo, tuple(parts)))
    return merge_copies(ops)


def merge_copies(ops: list[Op]) -> list[Op]:
    """Adjacent copies of adjacent source bytes become one (fewer system calls)."""
    out: list[Op] = []
    for op in ops:
        last = out[-1] if out else None
        if (isinstance(op, Copy) and isinstance(last, Copy) and last.path == op.path
                and last.offset + last.n == op.offset):
            out[-1] = Copy(op.path, last.offset, last.n + op.n)
        else:
            out.append(op)
    return out


@dataclass
class PlannedTensor:
    shape: tuple[int, ...]
    dtype: str
    ops: list[Op]
    # a ``minus_one`` tensor: the operations of its Megatron value (a Megatron source's stored bytes, carried
    # to a Megatron target as stored; from an HF source set by ``sources.plan_megatron_values``)
    megatron_ops: list[Op] | None = None


def megatron_entry_ops(entry: WeightEntry, blocks: list[Block], full_shape: tuple[int, ...], cfg,
                       where: str) -> dict[str, PlannedTensor]:
    """HF tensors of one weight-map entry from the blocks of its Megatron full tensor."""
    dtypes = {blk.t.dtype for blk in blocks}
    if len(dtypes) != 1:
        raise Unsupported(f"{where}: {entry.megatron} stored in several dtypes {sorted(dtypes)}")
    dtype = dtypes.pop()
    try:
        if entry.megatron_layout == GATE_UP_STACKED:
            half = full_shape[0] // 2
            ranges = [[(0, half)], [(half, full_shape[0])]]
        elif entry.megatron_layout == MINUS_ONE:  # the stored (Megatron) value; sources turn it into HF's
            ranges = [[(0, full_shape[0])]]
        else:
            ranges = row_ranges(entry, cfg, full_shape[0])
    except LayoutError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    out = {}
    for name, rng in zip(entry.hf, ranges):
        ops: list[Op] = []
        rows = 0
        for a, b in rng:
            ops += rows_ops(blocks, full_shape, a, b, f"{where}: {entry.megatron}")
            rows += b - a
        out[name] = PlannedTensor((rows, *full_shape[1:]), dtype, merge_copies(ops))
    return out


def legacy_blocks(entry: WeightEntry, shards: list[RawTensor], key: str) -> list[Block]:
    """Blocks of a Megatron full tensor held as legacy TP shards (see megatron_layout's split kinds)."""
    kind = tp_split_kind(entry, len(shards[0].shape))
    rows = shards[0].shape[0]
    if kind == REPLICATED:
        return [Block(0, 0, shards[0])]
    if kind == ROW0:
        return [Block(t * rows, 0, s) for t, s in enumerate(shards)]
    if kind == GATE_UP:
        half = rows // 2
        full_half = half * len(shards)
        return [b for t, s in enumerate(shards)
                for b in (Block(t * half, 0, s.rows(0, half)), Block(full_half + t * half, 0, s.rows(half, rows)))]
    if kind == COL1:
        width = shards[0].shape[1]
        return [Block(0, t * width, s) for t, s in enumerate(shards)]
    if kind == BLOCKS:  # rank t: the t-th row chunk of every component
        out = []
        for t, s in enumerate(shards):
            local = 0
            try:
                spans = blocks_shard_rows(packed_components(entry), len(shards), t, key)
            except LayoutError as exc:
                raise CheckpointError(str(exc)) from exc
            for a, b in spans:
                out.append(Block(a, 0, s.rows(local, local + b - a)))
                local += b - a
        return out
    raise Unsupported(f"{key}: split {kind}")
