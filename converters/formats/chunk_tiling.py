"""Do the stored chunks of a torch_dist tensor tile its global shape exactly once?

A torch_dist ``.metadata`` lists, per global tensor, the chunks the ranks saved (offsets and sizes).
They must cover the tensor without overlap, or a reader would take some elements from two chunks
(silently, from whichever it reads last) and leave others unset. Real checkpoints have many chunks:
megatron-core's TP2 save of Qwen3-30B-A3B stores ~24,600 for the stacked experts' ``linear_fc1``
alone, where comparing every pair of chunks takes ~15 minutes in Python.

The check therefore works on the grid the chunks' own edges cut the tensor into: per dimension the
sorted set of chunk starts and ends. Each chunk is a box of grid cells; no cell may belong to two
chunks, and the chunks' volumes must add up to the tensor's. Chunks of a real checkpoint are a
regular grid (each chunk one cell), so this is linear in the number of chunks. A tiling whose grid
has many more cells than chunks (staggered chunks, only from a hand-made or damaged file) falls
back to comparing pairs of chunks that share a start row band, which is exact and quadratic at worst.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

GRID_CELLS_PER_CHUNK = 8  # above this many grid cells per chunk (plus slack), compare chunk pairs instead


def _volume(sizes: Sequence[int]) -> int:
    n = 1
    for d in sizes:
        n *= d
    return n


def _overlap(a: Any, b: Any) -> bool:
    return all(max(x, y) < min(x + s, y + r) for x, s, y, r in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def _first_overlap_grid(chunks: list, cuts: list[list[int]]) -> tuple | None:
    index = [{v: i for i, v in enumerate(c)} for c in cuts]
    owner: dict[tuple, int] = {}
    for i, chunk in enumerate(chunks):
        ranges = [range(index[d][o], index[d][o + s]) for d, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes))]
        for cell in itertools.product(*ranges):
            j = owner.setdefault(cell, i)
            if j != i:  # by position: the same chunk listed twice overlaps itself
                return chunks[j], chunk
    return None


def _first_overlap_pairs(chunks: list) -> tuple | None:
    """Sweep along dimension 0: only chunks whose row bands intersect are compared."""
    ordered = sorted(chunks, key=lambda c: c.offsets[0] if c.offsets else 0)
    active: list = []
    for chunk in ordered:
        start = chunk.offsets[0] if chunk.offsets else 0
        active = [a for a in active if not a.offsets or a.offsets[0] + a.sizes[0] > start]
        for other in active:
            if _overlap(other, chunk):
                return other, chunk
        active.append(chunk)
    return None


def check_tiling(key: str, size: Sequence[int], chunks: Sequence[Any], fail: Callable[[str], Exception]) -> None:
    """Raise ``fail(message)`` unless ``chunks`` (objects with ``offsets`` and ``sizes``) cover a tensor
    of shape ``size`` exactly once; the message names a chunk outside the shape, the two overlapping
    chunks, or the coverage."""
    boxes = [c for c in chunks if _volume(c.sizes)]
    for c in boxes:
        if len(c.offsets) != len(size) or any(o < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, size)):
            raise fail(f"a chunk of {key} at offsets {tuple(c.offsets)} with sizes {tuple(c.sizes)} lies outside "
                       f"its shape {tuple(size)}")
    cuts = [sorted({o for c in boxes for o in (c.offsets[d], c.offsets[d] + c.sizes[d])}) for d in range(len(size))]
    cells = _volume([max(len(c) - 1, 0) for c in cuts]) if boxes else 0
    if cells <= GRID_CELLS_PER_CHUNK * len(boxes) + 1024:
        pair = _first_overlap_grid(boxes, cuts)
    else:
        pair = _first_overlap_pairs(boxes)
    if pair is not None:
        raise fail(f"chunks {pair[0].offsets} and {pair[1].offsets} of {key} overlap")
    covered = sum(_volume(c.sizes) for c in boxes)
    if covered != _volume(size):
        raise fail(f"chunks of {key} cover {covered} of {_volume(size)} elements")
