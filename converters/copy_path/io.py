"""How the copy path moves bytes: ``preadv``/``pwrite`` through one block per worker thread
(``BlockWriter``) -- no torch, no tensors in Python, memory bounded by one buffer per thread.

``fill_file`` executes a list of operations (``converters/copy_path/ops``) into an output file laid
out beforehand; the source ranges were validated by the format readers, so nothing here checks
them again (no system call per tensor beyond the copy itself).
"""

from __future__ import annotations

import os
import threading

from converters.copy_path.ops import Copy, Data, Interleave, Op, Transposed, Zeros
from converters.runtime.tasks import check_stop
from models.common.errors import CheckpointError

DEFAULT_BUFFER = 32 << 20  # buffer budget of all worker threads together (see thread_buffer)
BLOCK_BYTES = 2 << 20  # bytes assembled per write: small enough to stay in the CPU cache, see BlockWriter


def thread_buffer(buffer_bytes: int, workers: int) -> int:
    """Each worker thread's block: its share of the budget (the threads share one process's memory),
    at most ``BLOCK_BYTES`` (what ``preadv`` put in the buffer is still in the CPU cache when
    ``pwrite`` reads it: 32 MiB rounds took 1.5x the time of 1-4 MiB ones)."""
    return max(1, min(BLOCK_BYTES, buffer_bytes // max(1, workers)))


def fill_file(path: str, work: list[tuple[int, list[Op]]], buffer_bytes: int = DEFAULT_BUFFER) -> int:
    """Write every op's bytes at consecutive offsets starting at each work item's offset."""
    out = os.open(path, os.O_WRONLY)
    fd_of = SourceFiles()
    written = 0
    widths = [sum(p[2] for p in op.parts) for _, ops in work for op in ops if isinstance(op, Interleave)]
    writer = BlockWriter(out, path, buffer_bytes, max(widths, default=0))
    try:
        for dst, ops in work:
            writer.seek(dst)
            for op in ops:
                if isinstance(op, Copy):
                    writer.copy(fd_of(op.path), op.offset, op.n, op.path)
                elif isinstance(op, Zeros):
                    writer.skip(op.n)
                elif isinstance(op, Data):
                    writer.put(op.data)
                elif isinstance(op, Transposed):
                    writer.put(transposed_bytes(op, fd_of))
                else:
                    writer.interleave(op, fd_of)
                written += op.nbytes
        writer.flush()
    except OSError as exc:
        raise CheckpointError(f"{path}: write failed ({exc.strerror or exc})") from exc
    finally:
        os.close(out)
        fd_of.close()
    return written


# File systems whose buffered writes into preallocated (unwritten) extents skip the per-block delayed
# allocation work (ext4: ``ext4_da_get_block_prep``, buffer heads, quota, the extent status tree: a third
# of the CPU of writing an HF shard, measured by perf): ext4 and XFS. Not tmpfs (fallocate allocates and
# clears every page up front: slower in all), nor file systems not measured here.
_PREALLOCATE_FS = {0xEF53: "ext4", 0x58465342: "xfs"}
_libc = None


def _libc_calls():
    """(fstatfs, fallocate) from libc, or None where ctypes or either call is missing."""
    global _libc
    if _libc is None:
        _libc = False
        try:
            import ctypes

            lib = ctypes.CDLL(None, use_errno=True)
            fallocate, fstatfs = lib.fallocate, lib.fstatfs
            fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            fstatfs.argtypes = [ctypes.c_int, ctypes.c_char_p]
            _libc = (fstatfs, fallocate, ctypes)
        except (ImportError, OSError, AttributeError):
            pass
    return _libc or None


def preallocate(fd: int, size: int) -> bool:
    """Allocate ``size`` bytes of the file open as ``fd`` (``fallocate``, mode 0: unwritten extents that
    read as zeros, the size unchanged when it is already ``size``) on ext4 and XFS, before the tensors
    are copied in: writes then fill allocated blocks (30% less CPU per byte written on ext4, measured:
    ``pwrite`` of 64 KiB pieces 0.17 -> 0.12 s per 291 MB; ``fallocate`` itself ~1 ms), and a full
    disk fails here, at once, instead of half-way through the copy. True when done; False where it
    does not apply (another file system, no such call); ENOSPC / EDQUOT / EFBIG raise ``OSError``."""
    calls = _libc_calls() if size > 0 else None
    if calls is None:
        return False
    fstatfs, fallocate, ctypes = calls
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first field (a C long)
    if fstatfs(fd, buf) != 0 or ctypes.c_long.from_buffer(buf).value not in _PREALLOCATE_FS:
        return False
    if fallocate(fd, 0, 0, size) == 0:
        return True
    code = ctypes.get_errno()
    import errno

    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        raise OSError(code, os.strerror(code))
    return False  # EOPNOTSUPP and the like: the writes allocate as they go


def read_ops(ops: list[Op]) -> bytes:
    """The bytes a few small operations produce, in memory (a ``minus_one`` vector while planning)."""
    out = bytearray()
    for op in ops:
        if isinstance(op, Copy):
            fd = os.open(op.path, os.O_RDONLY)
            try:
                data = os.pread(fd, op.n, op.offset)
            finally:
                os.close(fd)
            if len(data) != op.n:
                raise CheckpointError(f"{op.path}: {op.n} bytes at offset {op.offset} cannot be read")
            out += data
        elif isinstance(op, Zeros):
            out += bytes(op.n)
        elif isinstance(op, Data):
            out += op.data
        else:
            raise CheckpointError(f"internal: read_ops of {type(op).__name__}")
    return bytes(out)


_ELEMENT_FORMATS = {1: "B", 2: "H", 4: "I", 8: "Q"}  # memoryview formats moving elements of these sizes


def ops_bytes(ops, fd_of) -> bytearray:
    """The bytes ``ops`` produce, in memory (the input of a ``Transposed``: a bounded block)."""
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
    """The bytes of ``op``: its input read (``ops_bytes``) and transposed element by element -- by numpy
    (a dependency of the project, imported only here: 2.5x the speed), else one strided memoryview slice
    assignment per row or column (whichever are fewer), in C too."""
    fmt = _ELEMENT_FORMATS.get(op.itemsize)
    if fmt is None:
        raise CheckpointError(f"internal: no transpose of {op.itemsize}-byte elements")
    data = ops_bytes(op.ops, fd_of)
    out = bytearray(op.nbytes)
    rows, cols = op.rows, op.cols
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        kind = np.dtype(f"<u{op.itemsize}")
        np.frombuffer(out, dtype=kind).reshape(cols, rows)[...] = np.frombuffer(data, dtype=kind).reshape(rows, cols).T
        return out
    src, dst = memoryview(data).cast(fmt), memoryview(out).cast(fmt)
    if rows <= cols:
        for r in range(rows):  # input row r is output column r
            dst[r::rows] = src[r * cols:(r + 1) * cols]
    else:
        for c in range(cols):  # input column c is output row c
            dst[c * rows:(c + 1) * rows] = src[c::cols]
    return out


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


# Bytes per write system call. Each write makes the page cache allocate folios of up to its size; on
# a VM whose free memory is handed back to the host (virtio-balloon free page reporting, of free
# blocks of 2 MiB and up) large folios come from exactly those blocks and every byte written waits
# for the host: 1.16 GB took 3-4 s in 2 MiB writes, 0.7-1 s in 256 KiB ones and 0.6-0.7 s in
# 64 KiB ones (what copy_file_range's splice writes, and cp's, amount to).
WRITE_BYTES = 64 << 10
_write_locks: dict[str, threading.Lock] = {}
_write_locks_guard = threading.Lock()


def write_lock(path: str) -> threading.Lock:
    """One lock per output file, held around each write to it. Writes to one file serialize on its
    inode lock anyway; with this lock a thread that would wait for it sleeps (it has read its next
    block already) instead of spinning on the kernel's lock, which took a third of the CPU time of
    two threads filling one HF shard."""
    with _write_locks_guard:
        lock = _write_locks.get(path)
        if lock is None:
            lock = _write_locks[path] = threading.Lock()
        return lock


class BlockWriter:
    """Destination bytes assembled in this thread's buffer (``preadv`` of the source ranges
    straight into it: whole ranges, and the rows of column bands into their columns) and written
    block by block, the blocks aligned to the block size in the destination file; a block is cut
    short only where the destination has a gap (an archive header written beforehand, or zeros left
    as a hole). Each write holds the file's ``write_lock``.

    Why not ``copy_file_range`` (one copy in the kernel instead of two through this buffer): on
    ext4, as everywhere it falls back to splicing (always, for byte ranges not aligned to the file
    system's blocks), it measured no faster here (copying into one file, as an HF shard is, 0.44 s
    for 1.16 GB against 0.29-0.34 s for ``preadv``/``pwrite`` in one thread), and two threads
    copying into one file spent a third of their time spinning on its inode lock."""

    def __init__(self, fd: int, path: str, buffer_bytes: int, max_width: int = 0) -> None:
        self.fd, self.path, self.lock = fd, path, write_lock(path)
        block = 1 << max(12, max(1, buffer_bytes).bit_length() - 1)  # a power of two, at least a page
        self.block = block
        self.buf = _buffer(block + 2 * max_width)  # room for a row that crosses the block's end
        self.views = RowViews(self.buf)
        self.base = 0  # destination offset of buf[0]
        self.fill = 0  # bytes in buf
        self.limit = block  # buf[:limit] ends on a block boundary of the destination

    def _reset(self, pos: int) -> None:
        self.base, self.fill = pos, 0
        self.limit = self.block - pos % self.block

    def seek(self, pos: int) -> None:
        if pos != self.base + self.fill:
            self.flush()
            self._reset(pos)

    def skip(self, n: int) -> None:
        """``n`` bytes left as they are (zeros of a file created at its final size)."""
        pos = self.base + self.fill + n
        self.flush()
        self._reset(pos)

    def flush(self) -> None:
        if self.fill:
            self._write(self.fill)

    def _write(self, n: int) -> None:
        """Write ``buf[:n]``; what follows it in the buffer moves to the front."""
        check_stop()
        with self.lock:
            for a in range(0, n, WRITE_BYTES):
                pwrite_all(self.fd, self.buf[a:min(n, a + WRITE_BYTES)], self.base + a)
        tail = self.fill - n
        if tail:
            self.buf[:tail] = bytes(self.buf[n:self.fill])  # less than a row: a small copy
        self._reset(self.base + n)
        self.fill = tail

    def copy(self, fd: int, offset: int, n: int, name: str) -> None:
        """``n`` bytes at ``offset`` of source ``fd``."""
        while n:
            m = min(n, self.limit - self.fill)
            preadv_exact(fd, [self.buf[self.fill:self.fill + m]], offset, name)
            self.fill += m
            offset += m
            n -= m
            if self.fill >= self.limit:
                self._write(self.limit)

    def put(self, data: bytes) -> None:
        """``data`` itself (bytes computed while planning, ``ops.Data``)."""
        view = memoryview(data)
        while view:
            m = min(len(view), self.limit - self.fill)
            self.buf[self.fill:self.fill + m] = view[:m]
            self.fill += m
            view = view[m:]
            if self.fill >= self.limit:
                self._write(self.limit)

    def interleave(self, op: Interleave, fd_of) -> None:
        """The rows of ``op``, each read straight into its place (``read_rows``)."""
        width = sum(p[2] for p in op.parts)
        r = 0
        while r < op.rows:
            k = min(op.rows - r, max(1, (self.limit - self.fill) // width))
            read_rows(op.parts, fd_of, r, self.buf[self.fill:self.fill + k * width], width, self.views, self.fill)
            self.fill += k * width
            r += k
            while self.fill >= self.limit:
                self._write(self.limit)


_GAP_READ = 16 << 10  # a gap between rows up to this size is read (into _DISCARD), not skipped by a system call
try:
    _IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX"))
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 16
if _IOV_MAX < 2:
    _IOV_MAX = 16
_DISCARD = memoryview(bytearray(_GAP_READ))  # gap bytes land here; shared, nobody reads it
_buffers = threading.local()


def _buffer(n: int) -> memoryview:
    """This thread's reusable buffer, ``n`` bytes of it (grown to the largest request; a fresh buffer
    per read would fault its pages in every time), page-aligned (``page_aligned``). Freed with the
    thread."""
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) < n:
        buf = _buffers.buf = page_aligned(n)
    return memoryview(buf)[:n]


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

    def __call__(self, start: int, k: int, width: int, col: int, nbytes: int, gap: int) -> list[tuple[list, int]]:
        """``row_spans`` of ``buf[start:start + k * width]``, cut into ``preadv`` calls of at most
        IOV_MAX buffers: ``[(buffers, their bytes), ...]``."""
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
