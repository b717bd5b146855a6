"""The copy path's Megatron op algebra: a Megatron tensor (full, or one TP rank's shard) as operations
on the source files, built from the source's planned HF tensors.

A Megatron tensor is rows of HF tensors (``linear_qkv``: per query group, q rows then k then v;
``linear_fc1``: gate then up; the embedding: vocab rows then zero padding) and a TP shard is rows
of it (column-parallel) or a column band of every row (row-parallel: ``linear_proj``,
``linear_fc2``). ``select`` cuts a planned tensor's operations down to such a block, so every
output tensor is again a short list of operations on the source files -- for a Megatron source
this is a reshard with no intermediate HF tensor.
"""

from __future__ import annotations

from typing import Any

from converters.copy_path.ops import (
    Copy,
    Interleave,
    Op,
    PlannedTensor,
    Transposed,
    Unsupported,
    Zeros,
    merge_copies,
)
from converters.copy_path.raw_source import RawSource
from converters.formats.tensors import ITEMSIZE
from converters.layout.hybrid import row_ranges
from converters.layout.megatron import (
    BLOCKS,
    COL1,
    GATE_UP,
    REPLICATED,
    ROW0,
    LayoutError,
    blocks_shard_rows,
    megatron_full_shape,
    packed_components,
    tp_split_kind,
)
from models.common.errors import CheckpointError
from models.common.weight_map import GATE_UP_STACKED, MINUS_ONE, VOCAB_PADDED, WeightEntry


def row_nbytes(shape: tuple[int, ...], tag: str) -> int:
    """Bytes of one row (dim 0 entry) of a row-major tensor; a 1-D tensor's rows are its elements."""
    n = ITEMSIZE[tag]
    for d in shape[1:]:
        n *= d
    return n


def select(pt: PlannedTensor, r0: int, r1: int, b0: int, b1: int) -> list[Op]:
    """Operations producing rows ``[r0, r1)`` and bytes ``[b0, b1)`` of each row of ``pt``."""
    width = row_nbytes(pt.shape, pt.dtype)
    out: list[Op] = []
    row = 0
    for op in pt.ops:
        if isinstance(op, Transposed):  # rows lo..hi, bytes b0..b1 of a transpose: the transpose of a block
            lo, hi = max(r0, row), min(r1, row + op.cols)
            if lo < hi:
                out.append(_transposed_block(op, pt.dtype, lo - row, hi - row, b0, b1))
            row += op.cols
            if row >= r1:
                break
            continue
        if isinstance(op, Interleave):
            k, parts = op.rows, op.parts
        else:
            if op.nbytes % width:
                raise CheckpointError(f"internal: an operation of {op.nbytes} bytes is not whole rows of {width} "
                                      f"bytes (tensor {pt.shape})")
            k = op.nbytes // width
            parts = None if isinstance(op, Zeros) else ((op.path, op.offset, width, width),)
        lo, hi = max(r0, row), min(r1, row + k)
        if lo < hi:
            if parts is None:
                out.append(Zeros((hi - lo) * (b1 - b0)))
            else:
                out.append(_band(parts, lo - row, hi - lo, b0, b1))
        row += k
        if row >= r1:
            break
    if row < r1:
        raise CheckpointError(f"internal: a planned tensor {pt.shape} has {row} rows, {r1} requested")
    return merge_copies(out)


def _transposed_block(op: Transposed, tag: str, lo: int, hi: int, b0: int, b1: int) -> Transposed:
    """Rows ``[lo, hi)`` and row bytes ``[b0, b1)`` of ``op``'s transpose: the transpose of input rows
    ``[b0, b1) / itemsize`` and input columns ``[lo, hi)``."""
    size = op.itemsize
    if b0 % size or b1 % size:
        raise CheckpointError(f"internal: bytes {b0}..{b1} of a transposed row cut its {size}-byte elements")
    if (lo, hi, b0, b1) == (0, op.cols, 0, op.rows * size):
        return op
    inner = select(PlannedTensor((op.rows, op.cols), tag, list(op.ops)), b0 // size, b1 // size, lo * size,
                   hi * size)
    return Transposed((b1 - b0) // size, hi - lo, size, tuple(inner))


def _band(parts: tuple, first: int, rows: int, b0: int, b1: int) -> Op:
    """Rows ``first..first+rows`` of an interleaved band, bytes ``[b0, b1)`` of each row."""
    picked, col = [], 0
    for path, offset, rb, stride in parts:
        a, b = max(b0, col), min(b1, col + rb)
        if a < b:
            picked.append((path, offset + first * stride + (a - col), b - a, stride))
        col += rb
    if len(picked) == 1:
        path, offset, rb, stride = picked[0]
        if rb == stride or rows == 1:
            return Copy(path, offset, rows * rb if rb == stride else rb)
    return Interleave(rows, tuple(picked))


def full_segments(entry: WeightEntry, cfg: Any, hf_shapes: dict,
                  padded_vocab: int) -> list[tuple[str | None, int, int]]:
    """The Megatron full tensor of ``entry`` as consecutive row ranges of its HF tensors
    (``(hf_name, a, b)``; ``None`` for zero rows): ``layout.hybrid.row_ranges`` (``layout.megatron.hf_row_ranges``,
    the rule the torch path's readers use, and the vision tower's per-head qkv)
    turned around, plus the stacked gate/up and the vocab padding."""
    layout = entry.megatron_layout
    if layout == GATE_UP_STACKED:
        return [(n, 0, hf_shapes[n][0]) for n in entry.hf]
    if layout == VOCAB_PADDED:
        rows = hf_shapes[entry.hf[0]][0]
        if padded_vocab < rows:
            raise LayoutError(f"{entry.megatron}: padded vocab {padded_vocab} < vocab {rows}")
        return [(entry.hf[0], 0, rows)] + ([(None, 0, padded_vocab - rows)] if padded_vocab > rows else [])
    full_rows = megatron_full_shape(entry, hf_shapes, cfg, padded_vocab)[0]
    placed = []  # (full row, hf name, hf row, rows)
    for name, ranges in zip(entry.hf, row_ranges(entry, cfg, full_rows)):
        h = 0
        for a, b in ranges:
            placed.append((a, name, h, b - a))
            h += b - a
    segments, row = [], 0
    for a, name, h, n in sorted(placed):
        if a != row:
            raise LayoutError(f"{entry.megatron}: rows {row}..{a} of {full_rows} come from no HF tensor")
        if segments and segments[-1][0] == name and segments[-1][2] == h:
            segments[-1] = (name, segments[-1][1], h + n)
        else:
            segments.append((name, h, h + n))
        row = a + n
    if row != full_rows:
        raise LayoutError(f"{entry.megatron}: rows {row}..{full_rows} come from no HF tensor")
    return segments


def full_rows_ops(source: RawSource, segments: list, rows: list[tuple[int, int]], b0: int, b1: int) -> list[Op]:
    """Operations for rows ``rows`` (ranges of the full tensor) and row bytes ``[b0, b1)``."""
    ops: list[Op] = []
    for a, b in rows:
        start = 0
        for name, s0, s1 in segments:
            n = s1 - s0
            lo, hi = max(a, start), min(b, start + n)
            if lo < hi:
                if name is None:
                    ops.append(Zeros((hi - lo) * (b1 - b0)))
                else:
                    ops += select(source.planned[name], s0 + lo - start, s0 + hi - start, b0, b1)
            start += n
    return merge_copies(ops)


def shard_ops(source: RawSource, entry: WeightEntry, hf_shapes: dict, padded: int, tp: int, t: int,
              key: str) -> tuple[tuple[int, ...], list[Op]]:
    """(shape, operations) of TP rank ``t``'s legacy shard of ``entry`` (``tp=1``: the full tensor)."""
    full = megatron_full_shape(entry, hf_shapes, source.cfg, padded)
    kind = REPLICATED if tp == 1 else tp_split_kind(entry, len(full))
    if entry.megatron_layout == MINUS_ONE:  # computed while planning (``sources.plan_megatron_values``)
        ops = source.planned[entry.hf[0]].megatron_ops
        if ops is None or kind != REPLICATED:
            raise CheckpointError(f"internal: {key} ({kind}) has no planned Megatron value")
        return full, ops
    segments = full_segments(entry, source.cfg, hf_shapes, padded)
    tag = source.planned[entry.hf[0]].dtype
    width = row_nbytes(full, tag)
    rows = full[0]
    if kind == REPLICATED:
        return full, full_rows_ops(source, segments, [(0, rows)], 0, width)
    if kind == ROW0:
        if rows % tp:
            raise LayoutError(f"{key}: size {rows} of dim 0 not divisible by tp={tp}")
        s = rows // tp
        return (s, *full[1:]), full_rows_ops(source, segments, [(t * s, (t + 1) * s)], 0, width)
    if kind == GATE_UP:
        if rows % (2 * tp):
            raise LayoutError(f"{key}: linear_fc1 rows {rows} not divisible by 2*tp = {2 * tp}")
        half, s = rows // 2, rows // (2 * tp)
        return (2 * s, *full[1:]), full_rows_ops(source, segments, [(t * s, (t + 1) * s),
                                                                     (half + t * s, half + (t + 1) * s)], 0, width)
    if kind == BLOCKS:  # the t-th row chunk of every component
        spans = blocks_shard_rows(packed_components(entry), tp, t, key)
        return (rows // tp, *full[1:]), full_rows_ops(source, segments, spans, 0, width)
    if kind == COL1:
        if full[1] % tp:
            raise LayoutError(f"{key}: size {full[1]} of dim 1 not divisible by tp={tp}")
        band = width // tp
        return (rows, full[1] // tp, *full[2:]), full_rows_ops(source, segments, [(0, rows)], t * band,
                                                               (t + 1) * band)
    raise Unsupported(f"{key}: split {kind}")
