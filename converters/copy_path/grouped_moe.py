"""Grouped-GEMM expert sources on the copy path: the HF tensors of an expert held in megatron-core's
``GroupedMLP`` ``weight1`` / ``weight2`` (legacy rank files, ``moe_grouped_gemm``), as operations on them.

``GroupedMLP`` keeps, per TP rank, ``weight1`` ``[H, E_local*2F/tp]`` and ``weight2`` ``[E_local*F/tp, H]``,
read by megatron-core as ``[E_local, H, 2F/tp]`` and ``[E_local, F/tp, H]``: local expert ``i``'s block is a
contiguous byte range, the *transpose* of its SequentialMLP shard (``converters/layout/experts``). So:

* ``gate_proj`` ``[F, H]``: for each TP rank ``t``, the transpose of columns ``[0, F/tp)`` of block ``i`` of
  rank ``t``'s ``weight1`` (``[H, 2F/tp]``); ``up_proj`` the same of columns ``[F/tp, 2F/tp)``;
* ``down_proj`` ``[H, F]``: the transpose of the ``[F, H]`` matrix made of block ``i`` of every rank's
  ``weight2`` (``[F/tp, H]`` each) one under the other.

Each is a list of ``ops.Transposed`` over column bands of those blocks (each band read in one piece of at
most ``TRANSPOSE_BYTES``, transposed in memory by ``copy_path.transpose``): no torch, bounded memory.
"""

from __future__ import annotations

from converters.copy_path.ops import Interleave, Op, PlannedTensor, Transposed, Unsupported
from converters.copy_path.transpose import preload_numpy
from converters.formats.tensors import ITEMSIZE, RawTensor
from converters.layout.experts import fc_of
from models.common.weight_map import WeightEntry

TRANSPOSE_BYTES = 4 << 20  # input bytes of one Transposed op (as megatron_moe.TRANSPOSE_BYTES)


def _bands(rows: int, cols: int, size: int, limit: int) -> list[tuple[int, int]]:
    """Column bands ``[c0, c1)`` of a ``[rows, cols]`` matrix, each at most ``limit`` bytes (one column at least)."""
    step = max(1, limit // max(1, rows * size))
    return [(c0, min(cols, c0 + step)) for c0 in range(0, cols, step)]


def _transposed_columns(pieces: list[tuple[str, int, int, int]], cols: tuple[int, int], size: int,
                        limit: int) -> list[Op]:
    """The transpose of columns ``cols`` of the matrix made of ``pieces`` one under the other (each
    ``(path, offset, rows, row stride in bytes)``, columns from ``offset``), as ``Transposed`` bands."""
    preload_numpy()  # on the planning thread (transpose.preload_numpy)
    rows = sum(p[2] for p in pieces)
    a, b = cols
    out: list[Op] = []
    for c0, c1 in _bands(rows, b - a, size, limit):
        width = (c1 - c0) * size
        ops = tuple(Interleave(n, ((path, offset + (a + c0) * size, width, stride),))
                    for path, offset, n, stride in pieces)
        out.append(Transposed(rows, c1 - c0, size, ops))
    return out


def grouped_expert_ops(entry: WeightEntry, stored: str, shards: list, slot: int, hidden: int, ffn: int,
                       limit: int | None = None) -> dict[str, PlannedTensor]:
    """HF tensors (name -> PlannedTensor) of the expert ``entry`` held as local block ``slot`` of the
    GroupedMLP tensor ``stored`` (``weight1`` / ``weight2``), whose TP shards are ``shards`` (ranks in order)."""
    limit = limit or TRANSPOSE_BYTES
    if not all(isinstance(s, RawTensor) for s in shards):
        raise Unsupported(f"{stored}: not a contiguous tensor")
    dtypes = {s.dtype for s in shards}
    if len(dtypes) != 1:
        raise Unsupported(f"{stored}: stored in several dtypes {sorted(dtypes)}")
    tag = dtypes.pop()
    size, tp = ITEMSIZE[tag], len(shards)
    f = ffn // tp  # each TP rank's expert width
    if fc_of(stored) == 1:  # block [H, 2f] per rank: gate columns [0, f), up columns [f, 2f)
        block = hidden * 2 * f * size
        out = {}
        for name, cols in zip(entry.hf, ((0, f), (f, 2 * f))):
            ops: list[Op] = []
            for s in shards:
                ops += _transposed_columns([(s.path, s.offset + slot * block, hidden, 2 * f * size)], cols, size,
                                           limit)
            out[name] = PlannedTensor((ffn, hidden), tag, ops)
        return out
    block = f * hidden * size  # block [f, H] per rank, stacked over ranks: [F, H]
    pieces = [(s.path, s.offset + slot * block, f, hidden * size) for s in shards]
    (name,) = entry.hf
    return {name: PlannedTensor((hidden, ffn), tag, _transposed_columns(pieces, (0, hidden), size, limit))}


__all__ = ["grouped_expert_ops", "TRANSPOSE_BYTES"]
