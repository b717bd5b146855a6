"""HuggingFace safetensors on the torch path: a reader over the format's validating reader, and a
streaming sharded writer.

The reader takes everything from ``converters.formats.hf.HFCheckpoint`` (config, validated
safetensors files, the weight map's names) and reads tensors through the safetensors library's lazy
slices. The writer fills files laid out up front by ``converters/formats/hf.py`` (names, shapes,
dtypes and byte offsets are known from the config), tensor by tensor at their planned offsets,
so it never holds more than one unit in memory, whatever ``--max-shard-size`` is. Tasks fill byte
ranges of the files; the plan alone decides the bytes, so output is deterministic.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from converters.formats import hf as hf_format
from converters.formats.hf import FilePlan, HFCheckpoint, plan_shards, split_file_plan, tensor_offsets  # noqa: F401
from converters.formats.hf_config import read_hf_config, write_config_dir
from converters.formats.tensors import ITEMSIZE, RawTensor, StridedTensor
from converters.layout.model import Unit, unit_entries
from converters.torch_path.reader import TORCH_DTYPES, CheckpointReader, MappedFiles, ReaderInfo, mixed_dtypes, reopen
from models.common.sources import CheckpointError, RenamedSource, SafetensorsSource
from parallel.sharding import Piece

SAFETENSORS_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


class HFReader(CheckpointReader):
    """An HF model directory (``config.json`` + safetensors), validated once (``HFCheckpoint``), read
    lazily tensor by tensor."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self._remember_args(self.path)
        ckpt = HFCheckpoint(path)  # refuses FP8 tensors first (converters/formats/quantized.py)
        self.hf_config, self.arch, self.cfg, self.wmap = ckpt.hf_config, ckpt.arch, ckpt.cfg, ckpt.wmap
        files = SafetensorsSource(path, ckpt.files)
        some = next(iter(sorted(files.names())), None)
        dtype = TORCH_DTYPES.get(files.dtype_name(some), torch.float32) if some else torch.float32
        self.info = ReaderInfo("hf", self.arch.name, {"tp": 1, "pp": 1}, len(files.files), dtype,
                               mixed_dtypes((n, t.dtype, t.path) for n, t in ckpt.tensors.items()))
        # other key layouts of the same model (Qwen2-VL's in-memory names) read under the weight map's
        self.source = RenamedSource(files, self.arch.canonical_name, self.path) if self.arch.hf_key_aliases else files
        # per-expert views into experts stored fused (``models.common.hf_files.per_expert_views``): mapped byte ranges
        self.views = {name: ckpt.tensors[name] for name in ckpt.views}
        self._mapped = MappedFiles()
        self._files = files

    def release_pages(self) -> None:
        """Also closes the safetensors files (reopened on the next read): the library maps each file and
        keeps every page read resident while its handle is open."""
        super().release_pages()
        self._files.close()

    def validate(self) -> None:
        """Nothing left to check: ``HFCheckpoint`` checked the files, the names and the shapes."""

    def read_unit(self, unit: Unit) -> dict[str, torch.Tensor]:
        out = {}
        for entry in unit_entries(self.wmap, unit):
            for name in entry.hf:
                view = self.views.get(name)
                if view is not None and view.stride is not None:  # a release checkpoint's transposed expert
                    numel = view.span // ITEMSIZE[view.dtype]
                    out[name] = self._mapped.tensor(StridedTensor(view.path, view.offset, numel, view.dtype,
                                                                  view.shape, view.stride, 0))
                elif view is not None:
                    out[name] = self._mapped.tensor(RawTensor(view.path, view.offset, view.dtype, view.shape))
                else:
                    out[name] = self.source.read(name, Piece(None))
        return out


def _madvise_dontneed():
    """``madvise(MADV_DONTNEED)`` on Linux (None elsewhere): lets go of file pages already written out."""
    import ctypes
    import mmap
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE

    def drop(t: torch.Tensor) -> None:
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        a, b = -(-start // page) * page, end // page * page
        if b > a:
            fn(a, b - a, 4)  # MADV_DONTNEED: clean file-backed pages are dropped, re-read from the file if touched

    return drop


_DROP_PAGES = _madvise_dontneed()


def _file_offset(piece: torch.Tensor, path: str) -> int | None:
    """Offset in ``path`` of a view into a memory mapping of that file (from /proc/self/maps)."""
    ptr = piece.data_ptr()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) < 6 or parts[5].strip() != path:
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= ptr < hi:
                    return ptr - lo + int(parts[2], 16)
    except OSError:
        return None
    return None


class _Copier:
    """Writes pieces into an output file: ``copy_file_range`` straight from the source checkpoint
    file when the piece is an untouched view of a memory-mapped source (tagged ``_pmz_source`` by
    its reader) and needs no dtype change — the bytes never pass through this process — else a
    normal write of the tensor's bytes."""

    def __init__(self, out) -> None:
        self.out = out
        self.sources: dict[str, int] = {}
        self.fast = hasattr(os, "copy_file_range") and os.path.exists("/proc/self/maps")

    def write(self, piece: torch.Tensor, dtype: torch.dtype) -> int:
        path = getattr(piece, "_pmz_source", None)
        if self.fast and path and piece.dtype == dtype and piece.is_contiguous():
            offset = _file_offset(piece, path)
            if offset is not None and self._copy(path, offset, piece.numel() * piece.element_size()):
                return piece.numel() * piece.element_size()
        n = self.out.write(tensor_bytes(piece.to(dtype)))
        release_mapped(piece)
        return n

    def _copy(self, path: str, src: int, count: int) -> bool:
        """``count`` bytes from ``path`` at ``src`` to the output's current position, in the kernel."""
        if path not in self.sources:
            self.sources[path] = os.open(path, os.O_RDONLY)
        fd, out = self.sources[path], self.out.fileno()
        self.out.flush()
        dst = self.out.tell()
        done = 0
        try:
            while done < count:
                n = os.copy_file_range(fd, out, count - done, src + done, dst + done)
                if n <= 0:
                    break
                done += n
        except OSError:
            if done == 0:
                self.fast = False  # not supported here (e.g. across filesystems): plain writes from now on
                return False
        while done < count:  # the kernel stopped short: finish with pread/pwrite
            chunk = os.pread(fd, min(count - done, 1 << 24), src + done)
            if not chunk:
                raise CheckpointError(f"{path}: ends before byte {src + count} of a tensor it holds")
            done += os.pwrite(out, chunk, dst + done)
        self.out.seek(dst + count)
        return True

    def close(self) -> None:
        for fd in self.sources.values():
            os.close(fd)
        self.sources.clear()


def release_mapped(piece: torch.Tensor) -> None:
    """Drop the resident pages of a piece that is a view into a read-only memory-mapped checkpoint
    (tagged ``_pmz_mapped`` by its reader), so resident memory holds one piece, not a whole unit."""
    if _DROP_PAGES is not None and getattr(piece, "_pmz_mapped", False):
        _DROP_PAGES(piece)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of ``t`` without an extra copy when it is already contiguous."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_shard_range(plan: FilePlan, directory: str, dtype: torch.dtype, lo: int, hi: int,
                      read_unit_pieces: Callable[[Unit], dict[str, list[torch.Tensor]]], *,
                      offsets: dict[str, int] | None = None,
                      write_tensor: Callable[..., int | None] | None = None) -> int:
    """Write tensors ``plan.tensors[lo:hi]`` at their planned offsets, streaming row pieces unit by unit.

    ``offsets``: file offset of each stored tensor (default: every tensor of ``plan`` in ``dtype``);
    ``write_tensor(f, name, pieces, offsets)``: writes a tensor its own way and returns its bytes, or
    None to have it copied as it is (the FP8 writer quantizes with it, ``torch_path/hf_fp8``)."""
    offsets = offsets if offsets is not None else tensor_offsets(plan, SAFETENSORS_DTYPE[dtype])
    todo = plan.tensors[lo:hi]
    wanted = {name: tuple(shape) for name, shape in todo}
    written = 0
    with open(Path(directory) / plan.name, "r+b") as f:
        copier = _Copier(f)
        for unit in plan.units:
            if not wanted:
                break
            pieces_of = read_unit_pieces(unit)
            for name in [n for n in pieces_of if n in wanted]:
                pieces = pieces_of.pop(name)
                shape = wanted.pop(name)
                got = (sum(p.shape[0] for p in pieces), *pieces[0].shape[1:])
                if got != shape or any(p.shape[1:] != pieces[0].shape[1:] for p in pieces):
                    raise CheckpointError(f"{name}: produced shape {got}, planned {shape}")
                own = write_tensor(f, name, pieces, offsets) if write_tensor is not None else None
                if own is not None:
                    written += own
                else:
                    f.seek(offsets[name])
                    for piece in pieces:
                        written += copier.write(piece, dtype)
                del pieces  # drop views into the source before the next unit is read
            del pieces_of
        copier.close()
    if wanted:
        raise CheckpointError(f"{plan.name}: tensor(s) {', '.join(sorted(wanted))} never produced by the reader")
    return written


def write_hf_config(reader: CheckpointReader, directory: str, dtype: torch.dtype, hf_config_dir: str | None) -> None:
    """config.json (from ``hf_config_dir`` when given, else the reader's config) plus the generation
    config, tokenizer files and chat template, byte for byte (``hf_config.write_config_dir``)."""
    config = read_hf_config(hf_config_dir) if hf_config_dir else reader.hf_config
    write_config_dir(config, directory, str(dtype).removeprefix("torch."))


def create_shard_file(plan: FilePlan, directory: str, dtype: torch.dtype) -> None:
    hf_format.create_shard_file(plan, directory, SAFETENSORS_DTYPE[dtype])


def write_index(files: list[FilePlan], directory: str, dtype: torch.dtype) -> None:
    hf_format.write_index(files, directory, SAFETENSORS_DTYPE[dtype])


def hf_plan(reader: CheckpointReader, dtype: torch.dtype, max_shard_bytes: int) -> list[FilePlan]:
    shapes = reader.hf_shapes()
    units = []
    for unit in reader.units():
        names = [n for e in unit_entries(reader.wmap, unit) for n in e.hf]
        units.append((unit, [(n, shapes[n]) for n in names]))
    return plan_shards(units, SAFETENSORS_DTYPE[dtype], max_shard_bytes, reader.wmap.fused_experts)


def write_hf(reader: CheckpointReader, directory: str, dtype: torch.dtype, *, max_shard_bytes: int, workers: int,
             progress: bool, files_from: str | None) -> None:
    """The HF checkpoint of ``reader`` in ``directory``: shards, index, config.json and the tokenizer
    files of ``files_from`` (an HF directory)."""
    from converters.runtime.tasks import run_tasks

    plan = hf_plan(reader, dtype, max_shard_bytes)
    # Files are laid out up front; tasks fill byte ranges of them (a big file is split between
    # workers). The layout comes from the plan alone, so the bytes never depend on workers.
    tasks = []
    for f in plan:
        create_shard_file(f, directory, dtype)
        parts = max(1, min(workers, len(f.tensors)) * 2 // max(1, len(plan)))
        tasks += [(_write_hf_range, (reader.reopen_args(), f, directory, dtype, lo, hi))
                  for lo, hi in split_file_plan(f, parts)]
    run_tasks(tasks, workers, "writing HF shards", progress)
    write_index(plan, directory, dtype)
    write_hf_config(reader, directory, dtype, files_from)


def _write_hf_range(reopen_args: tuple, plan: FilePlan, directory: str, dtype: torch.dtype, lo: int, hi: int) -> int:
    reader = reopen(reopen_args)

    def read_unit_pieces(unit: Unit) -> dict[str, list[torch.Tensor]]:
        reader.release_pages()  # the previous unit is written: its mapped source pages leave resident memory
        return reader.read_unit_pieces(unit)

    try:
        return write_shard_range(plan, directory, dtype, lo, hi, read_unit_pieces)
    finally:
        reader.close()


__all__ = ["HFReader", "hf_plan", "create_shard_file", "split_file_plan", "write_shard_range", "write_index",
           "write_hf", "write_hf_config"]
