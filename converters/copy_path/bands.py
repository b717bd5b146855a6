"""The copy path's column bands: a weight split by columns over TP ranks (a row-parallel linear: the
attention output, the MLP's down projection, each expert's ``linear_fc2``) written to every rank's file
from one read of each source row (``scatter_bands``), for the Megatron and vLLM writers alike.

Rows of whole source ranges are read with one ``preadv`` whose buffers alternate between the ranks'
blocks (row ``i``'s band ``t`` lands in row ``i`` of block ``t``): the kernel's copy to user memory does
the de-interleaving, and each block is then written with plain ``pwrite`` calls. Writing bands straight
from the rows (``pwritev``, one buffer per row) cost twice the CPU per byte of a contiguous write (1 GB
Qwen3-MoE to EP2 x TP2: 288 MiB of 512-byte bands in 0.41 s of ``pwritev`` against 0.60 s for the other
812 MiB), while reading into many buffers costs ~0.1-0.2 s per GB more than one buffer. Interleaved
sources (rows assembled from several ranges: vLLM's gate/up halves) are still read into rows and written
with ``pwritev``.
"""

from __future__ import annotations

import os
import threading

from converters.copy_path.io import WRITE_BYTES, pwrite_pieces, write_lock
from converters.copy_path.ops import Copy, Data, Interleave, Op, Transposed, Zeros
from converters.copy_path.vectored import SourceFiles, preadv_exact, pwritev_all, read_rows, thread_block, thread_views
from converters.runtime.tasks import check_stop
from models.common.errors import CheckpointError


def band_scatterable(ops: list[Op]) -> bool:
    """Whether ``scatter_bands`` can read these operations row by row: byte ranges of source files, interleaves
    and zeros only (a computed ``Data`` value or a ``Transposed`` block is cut by ``megatron_ops.select``
    instead). The one rule both writers that scatter bands (Megatron, vLLM) ask."""
    return not any(isinstance(op, (Data, Transposed)) for op in ops)


BAND_BATCH = 32 << 20  # source bytes of the bands one task scatters (one task per band opened its files each time)


def band_tasks(groups: list[tuple[list[Op], int, list]], buffer_bytes: int) -> list[tuple]:
    """``scatter_bands`` tasks for ``groups`` (``(ops, width, outputs)`` each), several groups per task up to
    ``BAND_BATCH`` source bytes: a MoE model has one group per expert's ``linear_fc2``, and one task each opened
    and closed the source and 2-4 rank files 264 times for a 1 GB Qwen3-MoE (~10% of its CPU)."""
    tasks, batch, acc = [], [], 0
    for group in groups:
        batch.append(group)
        acc += sum(op.nbytes for op in group[0])
        if acc >= BAND_BATCH:
            tasks.append((scatter_bands, (batch, buffer_bytes)))
            batch, acc = [], 0
    if batch:
        tasks.append((scatter_bands, (batch, buffer_bytes)))
    return tasks


def scatter_bands(groups: list[tuple[list[Op], int, list]], buffer_bytes: int) -> int:
    """For each group ``(ops, width, outputs)``: write column band ``t`` of the rows ``ops`` produce to
    ``outputs[t]`` (path, offset) -- or to each of a list of them: a MoE model's non-expert shard is in every
    EP rank's file --, reading each source row once: a TP split by columns would otherwise read every row
    ``tp`` times (``tp * ep``). Each write holds the output's ``write_lock``. Files are opened once for all
    the groups. Returns the bytes read."""
    fd_of = SourceFiles()
    outs: dict[str, int] = {}
    done = 0
    try:
        for ops, width, outputs in groups:
            done += _scatter(ops, width, outputs, buffer_bytes, fd_of, outs)
    except OSError as exc:  # reading a source; opening and writing are named in _scatter
        where = exc.filename or ", ".join(sorted(fd_of.fds))
        raise CheckpointError(f"{where}: cannot read ({exc.strerror or exc})") from exc
    finally:
        for fd in outs.values():
            os.close(fd)
        fd_of.close()
    return done


_grids = threading.local()
GRID_BUDGET = 1 << 16  # memoryviews the band grids of one thread keep (~13 MiB), least recently used dropped first


def band_grid(buf: memoryview, step: int, band: int, tp: int, rows: int) -> tuple[list, list]:
    """(the read buffers, the blocks) of up to ``step`` rows split into ``tp`` bands over ``buf``: block ``t`` is
    ``buf[t * step * band:][:step * band]``, and the read buffers are row 0 of block 0, row 0 of block 1, ...,
    row 1 of block 0, ...: a ``preadv`` of ``k <= rows`` whole rows into the first ``k * tp`` of them leaves band
    ``t`` of each row in block ``t``. Kept per shape and thread (a model's bands come in a few shapes, cycling layer
    by layer), made only as far as ``rows`` reaches (a tensor of 64 rows does not need a 2 MiB grid of 64-byte
    bands), at most ``GRID_BUDGET`` buffers in all."""
    cache = getattr(_grids, "cache", None)
    if cache is None:
        cache = _grids.cache = {}
    key = (id(buf.obj), step, band, tp)  # the views hold buf.obj: its id cannot be reused while they are kept
    hit = cache.pop(key, None)
    n = min(step, rows)
    if hit is None or len(hit[0]) < n * tp:
        blocks = [buf[t * step * band:(t + 1) * step * band] for t in range(tp)]
        if hit is not None:
            n = min(step, max(n, 2 * len(hit[0]) // tp))  # growing: double, as RowViews does
        reads = [None] * (n * tp)
        for t, block in enumerate(blocks):
            reads[t::tp] = map(block.__getitem__, map(slice, range(0, n * band, band), range(band, n * band + band,
                                                                                             band)))
        hit = (reads, blocks)
    cache[key] = hit  # most recently used last
    kept = sum(len(r) for r, _ in cache.values())
    while kept > GRID_BUDGET and len(cache) > 1:
        kept -= len(cache.pop(next(iter(cache)))[0])
    return hit


def _scatter(ops: list[Op], width: int, outputs: list, buffer_bytes: int, fd_of: SourceFiles,
             outs: dict[str, int]) -> int:
    """One group of ``scatter_bands``: output files opened into ``outs`` (path -> descriptor) as needed."""
    tp = len(outputs)
    band = width // tp
    if band * tp != width:
        raise CheckpointError(f"internal: a column band of {width}-byte rows split over {tp} ranks")
    flat = [(t, path, off) for t, out in enumerate(outputs) for path, off in ([out] if isinstance(out, tuple)
                                                                                  else out)]
    for _, path, _ in flat:
        if path not in outs:
            try:
                outs[path] = os.open(path, os.O_WRONLY)
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot open for writing ({exc.strerror or exc})") from exc
    step = max(1, buffer_bytes // width)
    buf = thread_block(step * width)
    locks = [write_lock(path) for _, path, _ in flat]
    row = 0
    for op in ops:
        if isinstance(op, Zeros):  # not produced for column-parallel weights; holes are zeros anyway
            row += op.nbytes // width
            continue
        if isinstance(op, Copy):
            _scatter_copy(op, width, band, tp, step, buf, fd_of, flat, locks, outs, row)
        else:
            _scatter_rows(op, width, band, step, buf, fd_of, flat, locks, outs, row)
        row += op.nbytes // width
    return row * width


def _scatter_copy(op: Copy, width: int, band: int, tp: int, step: int, buf: memoryview, fd_of: SourceFiles,
                  flat: list, locks: list, outs: dict[str, int], row: int) -> None:
    """Whole rows of one source range: read into the ranks' blocks (``band_grid``), each block written whole."""
    fd, rows = fd_of(op.path), op.nbytes // width
    reads, blocks = band_grid(buf, step, band, tp, rows)
    for r in range(0, rows, step):
        check_stop()
        k = min(step, rows - r)
        preadv_exact(fd, reads[:k * tp], op.offset + r * width, op.path)
        for lock, (t, path, dst) in zip(locks, flat):
            try:
                with lock:
                    pwrite_pieces(outs[path], blocks[t][:k * band], dst + (row + r) * band)
            except OSError as exc:
                raise CheckpointError(f"{path}: write failed ({exc.strerror or exc})") from exc


def _scatter_rows(op: Interleave, width: int, band: int, step: int, buf: memoryview, fd_of: SourceFiles,
                  flat: list, locks: list, outs: dict[str, int], row: int) -> None:
    """Rows assembled from several ranges: read into whole rows (``read_rows``), each band written from them
    (``pwritev``, one buffer per row)."""
    views = thread_views()  # the row buffers of reads and of each rank's band, kept from task to task
    per_write = max(1, WRITE_BYTES // band)  # rows per write (why: copy_path.io.WRITE_BYTES)
    for r in range(0, op.rows, step):
        check_stop()
        k = min(step, op.rows - r)
        read_rows(op.parts, fd_of, r, buf[:k * width], width, views)
        for lock, (t, path, dst) in zip(locks, flat):
            rows_t = views.rows(0, k, width, t * band, band)
            try:
                with lock:
                    for i in range(0, k, per_write):
                        pwritev_all(outs[path], rows_t[i:i + per_write], dst + (row + r + i) * band)
            except OSError as exc:
                raise CheckpointError(f"{path}: write failed ({exc.strerror or exc})") from exc


__all__ = ["BAND_BATCH", "GRID_BUDGET", "band_grid", "band_scatterable", "band_tasks", "scatter_bands"]
