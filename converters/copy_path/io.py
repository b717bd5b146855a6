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
from converters.copy_path.transpose import transpose_input, transpose_into, transposed_bytes
from converters.copy_path.vectored import SourceFiles, preadv_exact, pwrite_all, read_rows, thread_block, thread_views
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
    # the widest row that may cross a block's end: an interleaved row, a row of a transpose's output
    widths = [sum(p[2] for p in op.parts) if isinstance(op, Interleave) else op.rows * op.itemsize
              for _, ops in work for op in ops if isinstance(op, (Interleave, Transposed))]
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
                    writer.transposed(op, fd_of)
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


# Bytes per write system call, and the file offsets writes are cut at. Each write makes the page cache
# allocate folios of up to its size (where the write covers an aligned range of that size); on a VM
# whose free memory is handed back to the host (virtio-balloon free page reporting, of free blocks of
# 2 MiB and up) and fragmented by a large page cache, large folios come from exactly those blocks (or
# from compaction) and every byte written waits: 1.16 GB took 3-4 s in 2 MiB writes, 0.7-1 s in 256 KiB
# ones and 0.6-0.7 s in 64 KiB ones. Measured again on kernel 6.18: one thread writing 1 GB just after
# freeing as much, 256 KiB aligned writes took 13% less CPU than 64 KiB ones (0.40-0.42 against
# 0.45-0.48 s; 1 MiB 0.93-0.98, 2 MiB 3.4), but whole conversions of 3 GB took 2-2.5x the CPU of 64 KiB
# writes (HF -> HF 3.57 against 1.53 s): the memory state decides, and 64 KiB is the size that never
# fell off. Pieces are cut at the file's multiples of 64 KiB (``pwrite_pieces``): unaligned 64 KiB
# writes took 30% more CPU than aligned ones.
WRITE_BYTES = 64 << 10
_write_locks: dict[str, threading.Lock] = {}
_write_locks_guard = threading.Lock()


def pwrite_pieces(fd: int, data: memoryview, offset: int) -> None:
    """All of ``data`` at ``offset`` of ``fd``, one ``os.pwrite`` per piece of at most ``WRITE_BYTES``,
    the pieces cut at the file's multiples of ``WRITE_BYTES`` (why: ``WRITE_BYTES``). A short or failed
    write is done again in full by ``pwrite_all``, which continues it or raises."""
    write, end, a = os.pwrite, len(data), 0
    while a < end:
        b = min(end, a + WRITE_BYTES - (offset + a) % WRITE_BYTES)
        piece = data[a:b]
        if write(fd, piece, offset + a) != b - a:
            pwrite_all(fd, piece, offset + a)
        a = b


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
        self.buf = thread_block(block + 2 * max_width)  # room for a row that crosses the block's end
        self.views = thread_views()  # kept with the buffer, over all of it
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
            pwrite_pieces(self.fd, self.buf[:n], self.base)
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

    def transposed(self, op: Transposed, fd_of) -> None:
        """The transpose ``op`` stands for, written straight into the block a band of output rows at a time
        (``copy_path.transpose``: the input read into padded rows, tiles that stay in the CPU cache); an
        output row longer than the room past the block (no numpy, or a writer made without the widths)
        goes through ``transposed_bytes`` and ``put``."""
        width = op.rows * op.itemsize
        src = transpose_input(op, fd_of) if 0 < width <= len(self.buf) - self.block else None
        if src is None:
            self.put(transposed_bytes(op, fd_of))
            return
        j = 0
        while j < op.cols:
            k = min(op.cols - j, max(1, (self.limit - self.fill) // width))
            transpose_into(src, j, k, self.buf[self.fill:self.fill + k * width])
            self.fill += k * width
            j += k
            while self.fill >= self.limit:
                self._write(self.limit)
