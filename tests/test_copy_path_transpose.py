"""The copy path's transposes (``converters/copy_path/transpose``, issue 40): a ``Transposed`` operation
written by ``io.fill_file`` -- its input read into padded rows, transposed in tiles straight into the
writer's block -- gives the transpose of the bytes its operations stand for, whatever those are (byte
ranges cutting rows, interleaved rows with gaps, zeros, computed data, a transpose nested in the input),
for matrices whose sizes are not multiples of the tile or the cache line, output rows that cross the
block's end, with numpy and without. The reference is computed here element by element from the source
file's bytes (the conversions themselves are compared with the torch path in ``test_copy_path_moe``)."""

from __future__ import annotations

import random
import sys

import pytest

from converters.copy_path.io import fill_file
from converters.copy_path.ops import Copy, Data, Interleave, Transposed, Zeros


def _transpose(matrix: bytes, rows: int, cols: int, size: int) -> bytes:
    """Element ``(r, c)`` of the ``rows x cols`` row-major matrix goes to ``(c, r)``."""
    out = bytearray(len(matrix))
    for r in range(rows):
        for c in range(cols):
            i, j = (c * rows + r) * size, (r * cols + c) * size
            out[i:i + size] = matrix[j:j + size]
    return bytes(out)


def _input(path: str, data: bytes, rows: int, cols: int, size: int, rng: random.Random) -> tuple[list, bytes]:
    """Operations producing a ``rows x cols`` matrix of ``size``-byte elements, and its bytes: a byte range
    ending inside a row, zeros completing it, whole rows interleaved from two column pieces with gaps between
    source rows, a row of computed data, a nested transpose, then byte ranges cut at random places."""
    row = cols * size
    ops, want = [], bytearray()

    def copy(n: int) -> None:
        at = rng.randrange(0, len(data) - n)
        ops.append(Copy(path, at, n))
        want.extend(data[at:at + n])

    def rows_left() -> int:
        return rows - len(want) // row

    if rows >= 2 and row >= 2:
        copy(row + row // 2)
        ops.append(Zeros(row - row // 2))
        want.extend(bytes(row - row // 2))
    k = min(rows_left(), 5)
    if k and cols >= 2:
        left = (cols // 2) * size
        a, b = rng.randrange(0, 1000), rng.randrange(0, 1000)
        parts = ((path, a, left, left + 13), (path, 5000 + b, row - left, row - left + 3))
        ops.append(Interleave(k, parts))
        for i in range(k):
            want.extend(data[a + i * (left + 13):a + i * (left + 13) + left])
            want.extend(data[5000 + b + i * (row - left + 3):5000 + b + i * (row - left + 3) + row - left])
    if rows_left():
        value = bytes(rng.getrandbits(8) for _ in range(row))
        ops.append(Data(value))
        want.extend(value)
    if rows_left() >= 2 and cols >= 1:  # two rows made by a transpose of a [cols, 2] matrix
        at = rng.randrange(0, 2000)
        inner = data[at:at + 2 * row]
        ops.append(Transposed(cols, 2, size, (Copy(path, at, 2 * row),)))
        want.extend(_transpose(inner, cols, 2, size))
    while len(want) < rows * row:
        copy(min(rows * row - len(want), rng.randint(1, 3 * row)))
    return ops, bytes(want)


CASES = [(300, 7, 2), (131, 77, 2), (1, 5, 4), (5, 1, 4), (257, 129, 1), (3, 333, 8), (130, 64, 2), (2, 2, 2),
         (1100, 3, 2)]


@pytest.mark.parametrize("numpy,tile", [(True, None), (True, 7), (False, None)], ids=["numpy", "tiles-7", "no-numpy"])
@pytest.mark.parametrize("buffer_bytes", [4096, 1 << 20], ids=["rows-cross-blocks", "one-block"])
def test_transposed_operations_are_the_transpose_of_their_input(tmp_path, monkeypatch, numpy, tile, buffer_bytes):
    import converters.copy_path.transpose as transpose

    if not numpy:
        monkeypatch.setitem(sys.modules, "numpy", None)  # ``import numpy`` raises ImportError
    if tile:  # many tiles, the last one short, in every matrix of more than 7 rows
        monkeypatch.setattr(transpose, "TILE_ROWS", tile)
    rng = random.Random(11)
    data = bytes(rng.getrandbits(8) for _ in range(200_000))
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    work, want = [], {}
    at = 17  # after a "header": the block's grid starts off the file's start
    for rows, cols, size in CASES:
        ops, matrix = _input(str(src), data, rows, cols, size, rng)
        tail = Copy(str(src), 999, 7)  # a byte range right after the transpose, in the same block
        work.append((at, [Transposed(rows, cols, size, tuple(ops)), tail]))
        want[at] = _transpose(matrix, rows, cols, size) + data[999:1006]
        at += len(want[at]) + rng.randint(0, 50)
    out = tmp_path / "out.bin"
    out.write_bytes(bytes(at))
    assert fill_file(str(out), work, buffer_bytes) == sum(map(len, want.values()))
    got = out.read_bytes()
    for offset, expected in want.items():
        assert got[offset:offset + len(expected)] == expected, offset


def test_padded_stride_is_an_odd_number_of_cache_lines():
    from converters.copy_path.transpose import LINE, padded_stride

    for row in (1, 63, 64, 65, 128, 1024, 2048, 4096, 4097, 1536):
        stride = padded_stride(row)
        assert stride >= row and stride % LINE == 0 and (stride // LINE) % 2 == 1 and stride - row < 2 * LINE
