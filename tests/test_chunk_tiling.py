"""converters/formats/chunk_tiling.check_tiling against a brute-force reference written here: every
pair of chunks compared and every element of the tensor counted, on random chunkings of small
tensors (grids, grids with one chunk moved, cut or doubled, staggered bricks, empty chunks) and on
a chunking the size of a real Qwen3-30B-A3B expert tensor (which the old pairwise check took
minutes over; here it only has to finish, the suite does not time it)."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest

from converters.formats import chunk_tiling
from converters.formats.chunk_tiling import check_tiling


class Bad(Exception):
    pass


def _reference(size, chunks) -> bool:
    """True iff the non-empty chunks cover every element of ``size`` exactly once."""
    counts = {}
    for c in chunks:
        for cell in itertools.product(*(range(o, o + s) for o, s in zip(c.offsets, c.sizes))):
            counts[cell] = counts.get(cell, 0) + 1
    every = set(itertools.product(*(range(n) for n in size)))
    return set(counts) == every and all(v == 1 for v in counts.values())


def _chunk(offsets, sizes):
    return SimpleNamespace(offsets=tuple(offsets), sizes=tuple(sizes))


def _grid(size, rng):
    cuts = [sorted({0, n, *rng.sample(range(1, n), rng.randint(0, min(3, n - 1)))}) for n in size]
    return [_chunk([a for a, _ in box], [b - a for a, b in box])
            for box in itertools.product(*[list(zip(c, c[1:])) for c in cuts])]


def _bricks(size, rng):
    """Rows of chunks whose column cuts differ from row to row (not a grid)."""
    rows, cols = size
    out = []
    for r in range(rows):
        cuts = sorted({0, cols, *rng.sample(range(1, cols), rng.randint(0, min(2, cols - 1)))})
        out += [_chunk([r, a], [1, b - a]) for a, b in zip(cuts, cuts[1:])]
    return out


def _damage(chunks, rng):
    kind = rng.choice(["move", "cut", "double", "grow", "none", "empty"])
    chunks = list(chunks)
    i = rng.randrange(len(chunks))
    c = chunks[i]
    if kind == "move":
        d = rng.randrange(len(c.offsets))
        chunks[i] = _chunk([o + (1 if j == d else 0) for j, o in enumerate(c.offsets)], c.sizes)
    elif kind == "cut":
        chunks.pop(i)
    elif kind == "double":
        chunks.append(c)
    elif kind == "grow":
        d = rng.randrange(len(c.sizes))
        chunks[i] = _chunk(c.offsets, [s + (1 if j == d else 0) for j, s in enumerate(c.sizes)])
    elif kind == "empty":
        chunks.append(_chunk(c.offsets, [0] * len(c.sizes)))
    return chunks


@pytest.mark.parametrize("method", ["grid", "pairs"])
@pytest.mark.parametrize("seed", range(200))
def test_check_tiling_agrees_with_brute_force(seed, method, monkeypatch):
    if method == "pairs":  # the fallback for chunkings with many more grid cells than chunks
        monkeypatch.setattr(chunk_tiling, "GRID_CELLS_PER_CHUNK", -10**9)
    rng = random.Random(seed)
    if seed % 3 == 2:
        size = (rng.randint(1, 6), rng.randint(2, 7))
        chunks = _bricks(size, rng)
    else:
        size = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        chunks = _grid(size, rng)
    if seed % 2:
        chunks = _damage(chunks, rng)
    rng.shuffle(chunks)
    expected_ok = _reference(size, chunks)
    try:
        check_tiling("t", size, chunks, Bad)
        ok = True
    except Bad:
        ok = False
    assert ok == expected_ok, (size, [(c.offsets, c.sizes) for c in chunks])


def test_a_real_sized_expert_chunking_is_checked_and_an_overlap_named():
    """48 layers x 128 experts x 2 TP halves of [2F, H] (24,576 chunks), then one chunk doubled."""
    size = (48, 128, 1536, 2048)
    chunks = [_chunk([layer, e, t * 768, 0], [1, 1, 768, 2048])
              for layer in range(48) for e in range(128) for t in range(2)]
    check_tiling("decoder.layers.mlp.experts.experts.linear_fc1.weight", size, chunks, Bad)
    with pytest.raises(Bad, match=r"chunks \(47, 127, 768, 0\) and \(47, 127, 768, 0\) of decoder.* overlap"):
        check_tiling("decoder.layers.mlp.experts.experts.linear_fc1.weight", size, chunks + [chunks[-1]], Bad)
