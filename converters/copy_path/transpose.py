"""Transposes on the copy path: the bytes of an ``ops.Transposed`` (a grouped-GEMM expert block, read from
the source and transposed element by element), fast and in bounded memory.

The input matrix (``rows`` x ``cols``, at most ``megatron_moe.TRANSPOSE_BYTES``) is read into this thread's
buffer with each row on its own *padded* stride: an odd number of 64-byte cache lines. An expert's rows are
``H * itemsize`` or ``2F/tp * itemsize`` bytes, nearly always a multiple of 1-4 KiB; read as they lie, the
``rows`` elements of one output row sit one such stride apart, all in the same few L1 cache sets, and each
access evicts the last (numpy's ``out[...] = in.T`` moved 0.3-0.6 GB/s for ``[768, 2048]`` or ``[512, 1024]``
bf16 blocks, 2.5-4.5 GB/s with the padding; measured on this 2-core VM). Then the transpose is written in
tiles of ``TILE_ROWS`` input rows (their cache lines stay in L1 while every output row takes its piece of
them) straight into the destination -- the ``BlockWriter``'s block (``transpose_into``) -- without an
intermediate output buffer. numpy releases the GIL for these copies (more than 500 elements), so two worker
threads transpose on both cores. Where numpy is missing, ``transposed_bytes`` does it with memoryviews
(2.5x slower, the same bytes).
"""

from __future__ import annotations

import os
import sys
import threading

from converters.copy_path.ops import Copy, Data, Interleave, Op, Transposed, Zeros
from converters.copy_path.vectored import RowViews, page_aligned, preadv_exact, read_rows
from models.common.errors import CheckpointError

TILE_ROWS = 512  # input rows per tile: a cache line of each is 32 KiB, half of L1, kept while every output row
# takes its piece (fresh blocks, as the writer has them: 1.6-2.5 GB/s at 384-512 rows, 1.0-1.5 at 32-64)
LINE = 64  # bytes of a cache line
_ELEMENT_FORMATS = {1: "B", 2: "H", 4: "I", 8: "Q"}  # memoryview formats moving elements of these sizes
_inputs = threading.local()


def _numpy():
    """numpy, or None where it is not installed. Imported here the first time with OpenBLAS held to one thread
    (``OPENBLAS_NUM_THREADS=1`` for the import only, unless the user set it): the transposes use numpy's copies,
    never its BLAS, whose thread pool (started at import, one thread per core) spun beside the copy threads:
    ~1% of a GroupedMLP conversion's CPU samples (``perf``) and ~10 ms of the import."""
    np = sys.modules.get("numpy")
    if np is not None:
        return np
    pinned = "OPENBLAS_NUM_THREADS" not in os.environ and threading.current_thread() is threading.main_thread()
    if pinned:  # the environment is changed from the main thread only (planning; see preload_numpy)
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy as np
    except ImportError:
        return None
    finally:
        if pinned:
            os.environ.pop("OPENBLAS_NUM_THREADS", None)
    return np


def preload_numpy() -> None:
    """Import numpy now, on the planning (main) thread, when a plan holds a transpose: the worker threads would
    otherwise both wait on the import lock at their first transpose (~0.1 s of CPU), and only the main thread
    pins OpenBLAS's threads (``_numpy``)."""
    _numpy()


def padded_stride(row_bytes: int) -> int:
    """Bytes between consecutive input rows in the buffer: ``row_bytes`` rounded up to whole cache lines,
    an odd number of them (consecutive rows then fall in different cache sets)."""
    lines = max(1, -(-row_bytes // LINE))
    return (lines | 1) * LINE


def _thread_input(n: int) -> tuple[memoryview, RowViews]:
    """This thread's input buffer (``n`` bytes of it, page-aligned, grown to the largest request) and the
    row buffers over it (``RowViews``: made once per grid, as the writers' blocks)."""
    have = getattr(_inputs, "buf", None)
    if have is None or len(have) < n:
        have = _inputs.buf = page_aligned(n)
        _inputs.views = RowViews(memoryview(have))
    return memoryview(have)[:n], _inputs.views


def transpose_input(op: Transposed, fd_of, own: bool = False):
    """``op``'s input as a numpy ``[rows, cols]`` array (a view of padded rows, see the module's docstring)
    in this thread's input buffer (``own``: a buffer of its own, for a transpose nested in another's input);
    None without numpy."""
    np = _numpy()
    if np is None or op.itemsize not in _ELEMENT_FORMATS:
        return None
    row_bytes = op.cols * op.itemsize
    stride = padded_stride(row_bytes)
    n = op.rows * stride
    if own:
        buf = memoryview(page_aligned(n))[:n]
        views = RowViews(buf)
    else:
        buf, views = _thread_input(n)
    _read_rows_padded(op.ops, fd_of, buf, views, op.rows, row_bytes, stride)
    kind = np.dtype(f"<u{op.itemsize}")
    return np.frombuffer(buf, dtype=kind, count=n // op.itemsize).reshape(op.rows, stride // op.itemsize)[:, :op.cols]


def transpose_into(src, j: int, k: int, out: memoryview) -> None:
    """Rows ``[j, j + k)`` of the transpose of ``src`` (``[rows, cols]``: columns ``j .. j + k``) into ``out``
    (``k * rows`` elements), a tile of ``TILE_ROWS`` input rows at a time."""
    np = _numpy()
    rows = src.shape[0]
    dst = np.frombuffer(out, dtype=src.dtype, count=k * rows).reshape(k, rows)
    band = src[:, j:j + k]
    for i in range(0, rows, TILE_ROWS):
        dst[:, i:i + TILE_ROWS] = band[i:i + TILE_ROWS].T


def _read_rows_padded(ops: list[Op], fd_of, buf: memoryview, views: RowViews, rows: int, row_bytes: int,
                      stride: int) -> None:
    """The ``rows * row_bytes`` bytes ``ops`` produce, row ``r`` at ``buf[r * stride:]``: byte ranges and whole-row
    interleaves read straight into their rows (``preadv`` with a buffer per row, ``RowViews``); anything else
    (zeros, computed data, a nested transpose, an interleave whose rows are not the matrix's) made in memory first
    and copied into place."""
    pos = 0  # byte offset in the unpadded matrix
    for op in ops:
        n = op.nbytes
        r, c = divmod(pos, row_bytes)
        if stride == row_bytes and isinstance(op, Copy):
            preadv_exact(fd_of(op.path), [buf[pos:pos + n]], op.offset, op.path)
        elif isinstance(op, Copy):
            _copy_rows(fd_of(op.path), op.offset, n, pos, buf, views, row_bytes, stride, op.path)
        elif isinstance(op, Interleave) and c == 0 and n == op.rows * row_bytes:
            read_rows(op.parts, fd_of, 0, buf[r * stride:(r + op.rows) * stride], stride, views, r * stride)
        else:
            data = memoryview(bytes(n) if isinstance(op, Zeros) else ops_bytes([op], fd_of))
            at = 0
            for seg in _segments(buf, pos, n, row_bytes, stride):
                seg[:] = data[at:at + len(seg)]
                at += len(seg)
        pos += n
    if pos != rows * row_bytes:
        raise CheckpointError(f"internal: a transpose of {rows} x {row_bytes} bytes given {pos} bytes")


def _copy_rows(fd: int, offset: int, n: int, pos: int, buf: memoryview, views: RowViews, row_bytes: int,
               stride: int, name: str) -> None:
    """``n`` source bytes at ``offset`` into the padded rows from unpadded byte ``pos``: the rest of a row, whole
    rows (one buffer each, made once per grid), the start of a row."""
    r, c = divmod(pos, row_bytes)
    if c:
        m = min(n, row_bytes - c)
        preadv_exact(fd, [buf[r * stride + c:r * stride + c + m]], offset, name)
        offset, n, r = offset + m, n - m, r + 1
    k = n // row_bytes
    if k:
        for bufs, m in views(r * stride, k, stride, 0, row_bytes, 0):
            preadv_exact(fd, bufs, offset, name)
            offset += m
        r, n = r + k, n - k * row_bytes
    if n:
        preadv_exact(fd, [buf[r * stride:r * stride + n]], offset, name)


def _segments(buf: memoryview, pos: int, n: int, row_bytes: int, stride: int) -> list[memoryview]:
    """The pieces of the padded rows holding unpadded bytes ``[pos, pos + n)``, in order."""
    out = []
    while n:
        r, c = divmod(pos, row_bytes)
        m = min(n, row_bytes - c)
        out.append(buf[r * stride + c:r * stride + c + m])
        pos, n = pos + m, n - m
    return out


def ops_bytes(ops, fd_of) -> bytearray:
    """The bytes ``ops`` produce, in memory (a piece of a transpose's input that is not a byte range)."""
    out = bytearray(sum(op.nbytes for op in ops))
    view, pos = memoryview(out), 0
    for op in ops:
        n = op.nbytes
        if isinstance(op, Copy):
            preadv_exact(fd_of(op.path), [view[pos:pos + n]], op.offset, op.path)
        elif isinstance(op, Data):
            view[pos:pos + n] = op.data
        elif isinstance(op, Interleave):
            read_rows(op.parts, fd_of, 0, view[pos:pos + n], n // op.rows)
        elif isinstance(op, Transposed):
            view[pos:pos + n] = transposed_bytes(op, fd_of)
        pos += n  # Zeros: the buffer's own zeros
    return out


def transposed_bytes(op: Transposed, fd_of) -> bytearray:
    """The bytes of ``op`` in a buffer of their own (a transpose nested in another's input; no ``BlockWriter``
    room for it): numpy as above, in buffers of this call's own; without numpy one strided memoryview slice
    assignment per row or column (whichever are fewer), in C too."""
    fmt = _ELEMENT_FORMATS.get(op.itemsize)
    if fmt is None:
        raise CheckpointError(f"internal: no transpose of {op.itemsize}-byte elements")
    out = bytearray(op.nbytes)
    src = transpose_input(op, fd_of, own=True)
    if src is not None:
        transpose_into(src, 0, op.cols, memoryview(out))
        return out
    data = ops_bytes(op.ops, fd_of)
    rows, cols = op.rows, op.cols
    src, dst = memoryview(data).cast(fmt), memoryview(out).cast(fmt)
    if rows <= cols:
        for r in range(rows):  # input row r is output column r
            dst[r::rows] = src[r * cols:(r + 1) * cols]
    else:
        for c in range(cols):  # input column c is output row c
            dst[c * rows:(c + 1) * rows] = src[c::cols]
    return out


__all__ = ["TILE_ROWS", "padded_stride", "preload_numpy", "transpose_input", "transpose_into", "ops_bytes",
           "transposed_bytes"]
