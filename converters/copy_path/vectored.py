"""The copy path's vector reads and writes: ``preadv`` / ``pwritev`` of many buffers per system call
(short transfers continued), the rows of an interleaved band read straight into their columns of a
block (``read_rows``, with the per-row buffers made once per grid: ``RowViews``), and each worker
thread's reusable page-aligned buffer. No torch, no numpy: every copy-path writer and the transposes
(``copy_path.transpose``) read through here.
"""

from __future__ import annotations

import os
import threading

from models.common.errors import CheckpointError


class SourceFiles:
    """Source files opened once per task: ``fd_of(path)`` -> read-only descriptor; ``close()`` all."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}

    def __call__(self, path: str) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


_GAP_READ = 16 << 10  # a gap between rows up to this size is read (into _DISCARD), not skipped by a system call
try:
    _IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX"))
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 16
if _IOV_MAX < 2:
    _IOV_MAX = 16
_DISCARD = memoryview(bytearray(_GAP_READ))  # gap bytes land here; shared, nobody reads it
_buffers = threading.local()


def thread_block(n: int) -> memoryview:
    """This thread's reusable buffer, ``n`` bytes of it (grown to the largest request; a fresh buffer
    per read would fault its pages in every time), page-aligned (``page_aligned``). Freed with the
    thread. One per thread: the ``BlockWriter`` or ``scatter_bands`` of the task it runs."""
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) < n:
        buf = _buffers.buf = page_aligned(n)
        _buffers.views = RowViews(memoryview(buf))
    return memoryview(buf)[:n]


def thread_views() -> "RowViews":
    """The row buffers (``RowViews``) over this thread's whole buffer (``thread_block``), kept for the
    thread's life: every task a thread runs reads and writes rows of the same shapes on the same grids
    (one ``scatter_bands`` task per expert of a MoE model once built 2,000 views per task)."""
    views = getattr(_buffers, "views", None)
    if views is None:
        thread_block(1)
        views = _buffers.views
    return views


def page_aligned(n: int):
    """``n`` zero bytes starting on a page boundary: an anonymous private mapping (``bytearray(n)``
    where there is none). A ``bytearray`` starts 16 bytes into a page (malloc's header), so the
    kernel's copy of every page written from it (``pwrite``, whose blocks are aligned to the
    destination) spans two pages of the buffer. Whole ``pmz convert`` runs to HF, 8-10 alternating
    rounds against the same code with bytearrays: CPU 3-9% lower (legacy: min 0.68 -> 0.62 s per
    1.16 GB); stand-alone loops of ``preadv`` + ``pwrite`` varied more with the run than with it."""
    try:
        import mmap

        return mmap.mmap(-1, max(1, n), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (ImportError, AttributeError, OSError, ValueError, TypeError):
        return bytearray(n)


def pwrite_all(fd: int, data, offset: int) -> None:
    """All of ``data`` at ``offset``: a short write (a nearly full disk, a file size limit, some
    network file systems) is continued, so its error surfaces instead of a silent hole of zeros."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            import errno

            raise OSError(errno.EIO, f"wrote nothing at byte {offset}")
        view, offset = view[n:], offset + n


def pwritev_all(fd: int, buffers: list, offset: int) -> None:
    """``buffers`` one after the other at ``offset`` (``pwritev``, at most IOV_MAX of them per call;
    short writes are continued as in ``pwrite_all``)."""
    _vector_io(os.pwritev, fd, buffers, offset, None)


def preadv_exact(fd: int, buffers: list, offset: int, name: str) -> None:
    """Fill ``buffers`` one after the other from ``offset`` of ``fd`` (``preadv``); the file ending
    first is an error naming ``name``."""
    _vector_io(os.preadv, fd, buffers, offset, name)


def _vector_io(call, fd: int, buffers: list, offset: int, name: str | None) -> None:
    i = 0
    while i < len(buffers):
        chunk = buffers[i:i + _IOV_MAX]
        n = call(fd, chunk, offset)
        if n <= 0:
            if name is not None:
                raise CheckpointError(f"{name}: ends before byte {offset + sum(map(len, buffers[i:]))}")
            import errno

            raise OSError(errno.EIO, f"wrote nothing at byte {offset}")
        offset += n
        if n == sum(map(len, chunk)):  # the usual case: all of it
            i += len(chunk)
            continue
        for b in chunk:
            if n < len(b):  # a short transfer: go on from the rest of this buffer
                buffers = [b[n:], *buffers[i + 1:]]
                i = 0
                break
            n -= len(b)
            i += 1


def row_views(block: memoryview, k: int, width: int, col: int, nbytes: int) -> list:
    """``block[i * width + col:][:nbytes]`` for each row ``i < k`` (built in C loops: a block can
    hold thousands of rows)."""
    end = col + k * width
    return list(map(block.__getitem__, map(slice, range(col, end, width), range(col + nbytes, end + nbytes, width))))


def row_spans(block: memoryview, k: int, width: int, col: int, nbytes: int, gap: int) -> list:
    """``row_views``, with ``gap`` bytes of ``_DISCARD`` between consecutive rows (``gap`` > 0)."""
    rows = row_views(block, k, width, col, nbytes)
    if gap:
        spans = [_DISCARD[:gap]] * (2 * k - 1)
        spans[::2] = rows
        rows = spans
    return rows


class RowViews:
    """The per-row buffers ``read_rows`` reads into, over one buffer, made once and kept: a 2 MiB
    block of rows is thousands of memoryviews (building them per block took a third of the time
    of filling an expert's ``down_proj`` under TP2: 768-byte rows), and the rows of every block
    lie on the same grid of the buffer, up to its phase (where the first row starts, modulo the
    row width: a block starts with what crossed the previous block's end). So the buffers of
    every row of the whole buffer are made once per (phase, row width, columns, gap) and a block
    takes a slice of that list. At most ``BUDGET`` memoryviews are kept (~6 MiB; the oldest grids
    go first); a grid finer than that is made per block, as before. A grid is made only as far down the
    buffer as the blocks read so far reach (doubling as they reach further): a tensor of 64 rows of
    128 bytes needs 64 views, not the 16K of the whole 2 MiB buffer, whose making (and the garbage
    collections 16K new objects set off in a process holding torch) took longer than the copy."""

    BUDGET = 1 << 15

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.cache: dict[tuple, tuple[int, list]] = {}  # key -> (rows the grid covers, its spans)
        self.kept = 0  # memoryviews in the cache

    def rows(self, start: int, k: int, width: int, col: int, nbytes: int) -> list:
        """``row_views`` of ``buf[start:start + k * width]`` (no gaps), from the kept grid."""
        spans, first = self._grid(start, k, width, col, nbytes, 0)
        return spans[first:first + k]

    def __call__(self, start: int, k: int, width: int, col: int, nbytes: int, gap: int) -> list[tuple[list, int]]:
        """``row_spans`` of ``buf[start:start + k * width]``, cut into ``preadv`` calls of at most
        IOV_MAX buffers: ``[(buffers, their bytes), ...]``."""
        spans, first = self._grid(start, k, width, col, nbytes, gap)
        if not gap:
            return [(spans[i:min(first + k, i + _IOV_MAX)], (min(first + k, i + _IOV_MAX) - i) * nbytes)
                    for i in range(first, first + k, _IOV_MAX)]
        # rows at the even positions of spans, gaps between them; calls start on a row
        end, step = 2 * (first + k) - 1, max(2, _IOV_MAX - _IOV_MAX % 2)
        out = []
        for i in range(2 * first, end, step):
            j = min(end, i + step)
            n_rows = (j - i + 1) // 2
            out.append((spans[i:j], n_rows * nbytes + (j - i - n_rows) * gap))
        return out

    def _grid(self, start: int, k: int, width: int, col: int, nbytes: int, gap: int) -> tuple[list, int]:
        """(spans, index of the block's first row in them): the kept grid of this shape, made or extended
        as far as the block reaches; the block's own rows where the grid is too fine to keep."""
        phase, first = start % width, start // width
        key = (phase, width, col, nbytes, gap)
        have, spans = self.cache.get(key, (0, None))
        if have < first + k:
            total = (len(self.buf) - phase) // width
            per_row = 2 if gap else 1
            if total * per_row > self.BUDGET:  # too fine to keep: this block's rows only
                spans, first = row_spans(self.buf[start:start + k * width], k, width, col, nbytes, gap), 0
            else:
                rows = min(total, max(first + k, 2 * have))
                self.kept -= len(spans) if spans is not None else 0
                self.cache.pop(key, None)
                while self.cache and self.kept + rows * per_row > self.BUDGET:
                    self.kept -= len(self.cache.pop(next(iter(self.cache)))[1])
                spans = row_spans(self.buf[phase:phase + rows * width], rows, width, col, nbytes, gap)
                self.cache[key] = (rows, spans)
                self.kept += len(spans)
        return spans, first


def read_rows(parts: tuple, fd_of, r: int, block: memoryview, width: int, views: RowViews | None = None,
              start: int = 0) -> None:
    """Rows ``r .. r + k`` of an interleaved band into ``block`` (``k`` rows of ``width`` bytes, row
    after row): each part's rows are read straight into their columns of the block (``preadv`` with
    one buffer per row), without a copy in this process. ``views``: the block is
    ``views.buf[start:]`` and its row buffers come from there (made once per shape)."""
    k = len(block) // width
    col = 0
    for path, offset, rb, stride in parts:
        fd = fd_of(path)
        at = offset + r * stride
        if rb == width == stride:  # whole rows, one after the other: one read
            preadv_exact(fd, [block], at, path)
        elif stride - rb <= _GAP_READ:  # one read of the whole span; the gaps between rows land in _DISCARD
            if views is None:
                preadv_exact(fd, row_spans(block, k, width, col, rb, stride - rb), at, path)
            else:
                for bufs, n in views(start, k, width, col, rb, stride - rb):
                    if os.preadv(fd, bufs, at) != n:  # short (or failed): again, continuing where it stops
                        preadv_exact(fd, bufs, at, path)
                    at += n
        else:  # rows far apart: one read per row
            for i, row in enumerate(row_views(block, k, width, col, rb)):
                preadv_exact(fd, [row], at + i * stride, path)
        col += rb
