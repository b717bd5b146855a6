"""The copy path: a conversion that only moves bytes, planned from file metadata and executed with
``preadv``/``pwrite`` through one block per worker thread (``BlockWriter``) — no torch, no tensors
in Python, memory bounded by one buffer.

A Megatron -> HF conversion without a dtype change is a permutation of byte ranges: TP shards
that split rows (q/k/v, gate/up, embeddings) are contiguous ranges of the source files; shards that
split columns (``linear_proj``, ``linear_fc2``) are interleaved row by row. The planner reads only
metadata (safetensors headers, the pickles of ``torch.save`` archives, torch_dist ``.metadata``),
builds for every output tensor the list of ``Copy`` / ``Interleave`` operations that produce its
bytes, and checks every tensor the model needs on the way (presence, shapes, TP-consistency,
nothing unused) — so planning is also the validation, done before anything is written.

Which rows go where comes from the architecture's weight map and ``converters/megatron_layout``
(the same tables the torch path uses); the output files are laid out by
``converters/safetensors_layout``, so both paths write identical bytes. Sources the copy path
does not cover (dtype changes, non-contiguous storages, compressed archives, expert parallelism)
raise ``Unsupported`` and the engine falls back to the torch path.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from converters.checkpoint import EMBED, FINAL, Unit
from converters.megatron_layout import (
    COL1,
    GATE_UP,
    REPLICATED,
    ROW0,
    LayoutError,
    hf_row_ranges,
    megatron_full_shape,
    tp_split_kind,
)
from converters.raw_files import (
    ITEMSIZE,
    TAG_TO_TORCH_NAME,
    NonContiguous,
    RawTensor,
    Unsupported,
    read_pickle,
    read_safetensors,
    read_torch_archive,
)
from converters.safetensors_layout import FilePlan, header, nbytes, plan_shards, split_file_plan, tensor_offsets
from converters.tasks import check_stop
from models.common.errors import CheckpointError
from models.common.weight_map import GATE_UP_STACKED, IGNORED_SUFFIXES, WeightEntry

DEFAULT_BUFFER = 32 << 20  # buffer budget of all worker threads together (see thread_buffer)


@dataclass(frozen=True)
class Copy:
    """``n`` bytes at ``offset`` of ``path``, copied as they are."""

    path: str
    offset: int
    n: int

    @property
    def nbytes(self) -> int:
        return self.n


@dataclass(frozen=True)
class Interleave:
    """``rows`` rows, row r being the concatenation of row r of every part
    (``(path, offset, row_nbytes, stride)``: row r of a part is ``row_nbytes`` bytes at
    ``offset + r * stride`` of the source file; ``stride == row_nbytes`` for a contiguous block)."""

    rows: int
    parts: tuple[tuple[str, int, int, int], ...]

    @property
    def nbytes(self) -> int:
        return self.rows * sum(p[2] for p in self.parts)


@dataclass(frozen=True)
class Zeros:
    """``n`` zero bytes (Megatron's vocab padding): nothing is written, output files are created
    at their final size and read back as zeros where nothing was written."""

    n: int

    @property
    def nbytes(self) -> int:
        return self.n


Op = Union[Copy, Interleave, Zeros]


@dataclass(frozen=True)
class Block:
    """A contiguous piece of a Megatron full tensor, seen as a matrix [rows, cols]: rows
    ``[r0, r0 + t.shape[0])`` and columns ``[c0, c0 + width)`` (1-D tensors: one column)."""

    r0: int
    c0: int
    t: RawTensor

    @property
    def width(self) -> int:
        return self.t.numel // self.t.shape[0] if self.t.shape and self.t.shape[0] else 1


def rows_ops(blocks: list[Block], shape: tuple[int, ...], a: int, b: int, what: str) -> list[Op]:
    """Operations producing rows ``[a, b)`` of the full tensor made of ``blocks``, in order."""
    cols = 1
    for d in shape[1:]:
        cols *= d
    cuts = sorted({a, b, *(x for blk in blocks for x in (blk.r0, blk.r0 + blk.t.shape[0]) if a < x < b)})
    ops: list[Op] = []
    for lo, hi in zip(cuts, cuts[1:]):
        band = sorted((blk for blk in blocks if blk.r0 <= lo and hi <= blk.r0 + blk.t.shape[0]), key=lambda x: x.c0)
        col = 0
        for blk in band:
            if blk.c0 != col:
                raise CheckpointError(f"{what}: stored pieces leave columns {col}..{blk.c0} of rows {lo}..{hi} "
                                      f"uncovered")
            col += blk.width
        if col != cols:
            raise CheckpointError(f"{what}: stored pieces cover {col} of {cols} columns of rows {lo}..{hi}")
        if len(band) == 1:
            t = band[0].t.rows(lo - band[0].r0, hi - band[0].r0)
            ops.append(Copy(t.path, t.offset, t.nbytes))
        else:
            parts = []
            for blk in band:
                t = blk.t.rows(lo - blk.r0, hi - blk.r0)
                parts.append((t.path, t.offset, t.row_nbytes, t.row_nbytes))
            ops.append(Interleave(hi - lo, tuple(parts)))
    return _merge_copies(ops)


def _merge_copies(ops: list[Op]) -> list[Op]:
    """Adjacent copies of adjacent source bytes become one (fewer system calls)."""
    out: list[Op] = []
    for op in ops:
        last = out[-1] if out else None
        if (isinstance(op, Copy) and isinstance(last, Copy) and last.path == op.path
                and last.offset + last.n == op.offset):
            out[-1] = Copy(op.path, last.offset, last.n + op.n)
        else:
            out.append(op)
    return out


@dataclass
class PlannedTensor:
    shape: tuple[int, ...]
    dtype: str
    ops: list[Op]


def megatron_entry_ops(entry: WeightEntry, blocks: list[Block], full_shape: tuple[int, ...], cfg,
                       where: str) -> dict[str, PlannedTensor]:
    """HF tensors of one weight-map entry from the blocks of its Megatron full tensor."""
    dtypes = {blk.t.dtype for blk in blocks}
    if len(dtypes) != 1:
        raise Unsupported(f"{where}: {entry.megatron} stored in several dtypes {sorted(dtypes)}")
    dtype = dtypes.pop()
    try:
        if entry.megatron_layout == GATE_UP_STACKED:
            half = full_shape[0] // 2
            ranges = [[(0, half)], [(half, full_shape[0])]]
        else:
            ranges = hf_row_ranges(entry, cfg, full_shape[0])
    except LayoutError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    out = {}
    for name, rng in zip(entry.hf, ranges):
        ops: list[Op] = []
        rows = 0
        for a, b in rng:
            ops += rows_ops(blocks, full_shape, a, b, f"{where}: {entry.megatron}")
            rows += b - a
        out[name] = PlannedTensor((rows, *full_shape[1:]), dtype, _merge_copies(ops))
    return out


def legacy_blocks(entry: WeightEntry, shards: list[RawTensor], key: str) -> list[Block]:
    """Blocks of a Megatron full tensor held as legacy TP shards (see megatron_layout's split kinds)."""
    kind = tp_split_kind(entry, len(shards[0].shape))
    rows = shards[0].shape[0]
    if kind == REPLICATED:
        return [Block(0, 0, shards[0])]
    if kind == ROW0:
        return [Block(t * rows, 0, s) for t, s in enumerate(shards)]
    if kind == GATE_UP:
        half = rows // 2
        full_half = half * len(shards)
        return [b for t, s in enumerate(shards)
                for b in (Block(t * half, 0, s.rows(0, half)), Block(full_half + t * half, 0, s.rows(half, rows)))]
    if kind == COL1:
        width = shards[0].shape[1]
        return [Block(0, t * width, s) for t, s in enumerate(shards)]
    raise Unsupported(f"{key}: split {kind}")


# ------------------------------------------------------------------------------------------ sources


class RawSource:
    """A checkpoint as planned byte ranges. Subclasses fill ``planned`` (HF name -> PlannedTensor)."""

    format: str
    path: str
    hf_config: Any
    cfg: Any
    wmap: Any
    planned: dict[str, PlannedTensor]
    hf_config_dir: str | None = None
    iteration: int | None = None  # Megatron sources: the iteration recorded in the checkpoint
    layout: dict | None = None  # Megatron sources with args: megatron_files.args_layout (tp, pp, vpp, ...)

    def _set_model(self, hf_config: Any, where: str) -> None:
        from converters.checkpoint import model_from_config

        self.hf_config = hf_config
        self.arch, self.cfg, self.wmap = model_from_config(hf_config, where, megatron=self.format != "hf")
        if self.cfg.moe is not None:
            raise Unsupported("mixture of experts (the torch path converts it)")

    def units(self) -> list[tuple[Unit, list[WeightEntry]]]:
        out: list[tuple[Unit, list[WeightEntry]]] = [(EMBED, list(self.wmap.first_entries))]
        out += [(i, [e.format(i) for e in self.wmap.layer_entries]) for i in range(self.cfg.num_hidden_layers)]
        out.append((FINAL, list(self.wmap.last_entries)))
        return out

    def dtype(self) -> str:
        dtypes = {p.dtype for p in self.planned.values()}
        if len(dtypes) != 1:
            raise Unsupported(f"{self.path}: tensors in several dtypes {sorted(dtypes)}")
        return next(iter(dtypes))

    def check_shapes(self) -> None:
        from models.common.weight_map import hf_shapes

        expected = hf_shapes(self.cfg, self.wmap)
        for name, shape in expected.items():
            got = self.planned.get(name)
            if got is None:
                raise CheckpointError(f"{self.path}: no source for tensor {name}")
            if tuple(got.shape) != tuple(shape):
                raise CheckpointError(f"{self.path}: {name} would have shape {got.shape}, the config implies {shape}")


class HFRawSource(RawSource):
    format = "hf"

    def __init__(self, path: str, hf_config: Any) -> None:
        self.path = str(path)
        self.hf_config_dir = self.path
        self._set_model(hf_config, self.path)
        tensors: dict[str, RawTensor] = {}
        owner: dict[str, str] = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            for stored, t in read_safetensors(f).items():
                name = self.arch.canonical_name(stored)  # other key layouts of the same model (Qwen2-VL)
                if name in tensors:
                    raise CheckpointError(f"{path}: tensor {name} is in both {Path(owner[name]).name} and {f.name}"
                                          + (f" (one of them as {stored})" if stored != name else ""))
                tensors[name], owner[name] = t, str(f)
        from models.common.weight_map import hf_shapes

        expected = hf_shapes(self.cfg, self.wmap)
        problems = [f"missing tensor {n}" for n in expected if n not in tensors]
        problems += [f"{n} has shape {tensors[n].shape}, expected {s}" for n, s in expected.items()
                     if n in tensors and tuple(tensors[n].shape) != tuple(s)]
        allowed = {"lm_head.weight"} if self.cfg.tie_word_embeddings else set()
        problems += [f"unexpected tensor {n}" for n in tensors
                     if n not in expected and n not in allowed and not n.endswith(IGNORED_SUFFIXES)]
        if problems:
            raise CheckpointError(f"{path}: " + "; ".join(problems[:8]))
        self.planned = {n: PlannedTensor(tensors[n].shape, tensors[n].dtype, [Copy(tensors[n].path, tensors[n].offset,
                                                                                  tensors[n].nbytes)])
                        for n in expected}


class LegacyRawSource(RawSource):
    """Megatron legacy rank files (``mp_rank_TT[_PPP]/model_optim_rng.pt``), read as byte ranges."""

    format = "megatron"

    def __init__(self, path: str, *, arch: str | None = None, hf_config_dir: str | None = None,
                 vocab_size: int | None = None) -> None:
        from converters.megatron_files import (
            RANK_DIR,
            args_layout,
            hf_config_from_args,
            legacy_rank_dir_name,
            resolve_iteration_dir,
        )
        from converters.megatron_stages import RANK_FILE, MegatronLayout, chunk_state, lookup_key, unit_megatron_keys

        self.path = str(path)
        self.hf_config_dir = hf_config_dir
        it_dir = resolve_iteration_dir(Path(path))
        names = sorted(p.name for p in it_dir.iterdir() if p.is_dir() and RANK_DIR.match(p.name))
        if not names:
            raise CheckpointError(f"{it_dir}: no mp_rank_* folders")
        if any(RANK_DIR.match(n).group(3) for n in names):
            raise Unsupported("expert parallel")  # mp_rank_TT_PPP_EEE: PP and EP
        has_pp = any(RANK_DIR.match(n).group(2) for n in names)
        first = it_dir / ("mp_rank_00_000" if has_pp else "mp_rank_00") / RANK_FILE
        if not first.is_file():
            raise CheckpointError(f"{first}: missing rank file")
        data = read_torch_archive(first)
        args = data.get("args") if isinstance(data, dict) else None
        if args is None:
            raise CheckpointError(f"{first}: no 'args' (not written by Megatron-LM?)")
        lay = args_layout(args)
        self.layout = lay
        iteration = getattr(args, "iteration", data.get("iteration"))
        self.iteration = iteration if isinstance(iteration, int) and not isinstance(iteration, bool) else None
        tp, pp, vpp = lay["tp"], lay["pp"], lay["vpp"]
        if lay["ep"] > 1:
            raise Unsupported("expert parallel")
        expected_dirs = {legacy_rank_dir_name(t, p, pp) for t in range(tp) for p in range(pp)}
        if set(names) != expected_dirs:
            raise Unsupported("rank folders differ from the args (the torch path names them)")
        self._set_model(hf_config_from_args(args, arch=arch, hf_config_dir=hf_config_dir, vocab_size=vocab_size,
                                            where=str(it_dir)), self.path)
        stages = MegatronLayout(self.cfg.num_hidden_layers, pp, vpp, lay["first"], lay["last"], str(it_dir))
        padded = int(getattr(args, "padded_vocab_size", 0) or self.cfg.vocab_size)
        from models.common.weight_map import hf_shapes

        shapes = hf_shapes(self.cfg, self.wmap)
        self.planned = {}
        for p in range(pp):
            files = [it_dir / legacy_rank_dir_name(t, p, pp) / RANK_FILE for t in range(tp)]
            archives = [data if f == first else read_torch_archive(f) for f in files]
            for v in range(vpp):
                states = [chunk_state(a, v, vpp, f) for a, f in zip(archives, files)]
                used: set[str] = set()
                for unit, local in stages.stage_units(p, v):
                    for entry, key in unit_megatron_keys(self.wmap, unit, local):
                        shards = []
                        for f, s in zip(files, states):
                            found, t = lookup_key(s, key)
                            if t is None:
                                raise CheckpointError(f"{f}: missing tensor {key} (chunk {v})")
                            if isinstance(t, NonContiguous) or not isinstance(t, RawTensor):
                                raise Unsupported(f"{f}: {key} is not a contiguous tensor")
                            used.add(found)
                            shards.append(t)
                        if len({s.shape for s in shards}) != 1:
                            raise CheckpointError(f"{it_dir}: tensor {key} (pp rank {p}, chunk {v}) has different "
                                                  f"shapes across TP ranks: {[s.shape for s in shards]}")
                        full = megatron_full_shape(entry, shapes, self.cfg, padded)
                        self._check_shard(entry, key, shards[0].shape, full, tp, it_dir)
                        blocks = legacy_blocks(entry, shards, key)
                        self.planned.update(megatron_entry_ops(entry, blocks, full, self.cfg, str(it_dir)))
                tied = self.cfg.tie_word_embeddings and p == pp - 1 and v == vpp - 1
                for f, s in zip(files, states):
                    unused = sorted(k for k in s if k not in used and not k.endswith("_extra_state")
                                    and not (tied and k == "output_layer.weight"))
                    if unused:
                        raise CheckpointError(f"{f}: unused tensor(s) {', '.join(unused[:8])}"
                                              f"{' ...' if len(unused) > 8 else ''} (not part of a "
                                              f"{self.arch.name} model)")
        self.check_shapes()

    def _check_shard(self, entry: WeightEntry, key: str, shard: tuple, full: tuple, tp: int, where: Path) -> None:
        kind = tp_split_kind(entry, len(full))
        expected = list(full)
        if kind in (ROW0, GATE_UP):
            expected[0] //= tp
        elif kind == COL1:
            expected[1] //= tp
        if tuple(expected) != tuple(shard):
            raise CheckpointError(f"{where}: tensor {key} has shape {tuple(shard)} per TP rank, the model config "
                                  f"implies {tuple(expected)} (tp={tp})")


class DistRawSource(RawSource):
    """A torch_dist checkpoint: global tensors stored as chunks of ``__R_I.distcp`` files."""

    format = "megatron-dist"

    def __init__(self, it_dir: str, hf_config: Any, where: str, md: Any, data: Any) -> None:
        """``md``: the unpickled ``.metadata``; ``data``: what ``common.pt`` holds (None without one),
        both as ``open_raw_source`` read them."""
        from converters.megatron_stages import dist_key

        self.path = str(it_dir)
        self._set_model(hf_config, where)
        args = data.get("args") if isinstance(data, dict) else None
        iteration = data.get("iteration") if isinstance(data, dict) else None
        if args is not None:
            from converters.megatron_files import args_layout

            self.layout = args_layout(args)
            if getattr(args, "iteration", None) is not None:
                iteration = args.iteration
        self.iteration = iteration if isinstance(iteration, int) and not isinstance(iteration, bool) else None
        try:
            tensors = {k: v for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}
            storage = {(idx.fqn, tuple(idx.offset) if getattr(idx, "offset", None) is not None else None): info
                       for idx, info in md.storage_data.items()}
        except (AttributeError, TypeError) as exc:
            raise CheckpointError(f"{it_dir}/.metadata: unexpected structure ({exc})") from exc
        emb = tensors.get("embedding.word_embeddings.weight")
        padded = int(emb.size[0]) if emb is not None else self.cfg.vocab_size
        from models.common.weight_map import hf_shapes

        shapes = hf_shapes(self.cfg, self.wmap)
        archives: dict[tuple, RawTensor] = {}

        def chunk_tensor(key: str, offsets: tuple) -> RawTensor:
            info = storage.get((key, offsets))
            if info is None:
                raise CheckpointError(f"{it_dir}: .metadata lists chunk {offsets} of {key} but no storage for it")
            cache_key = (key, offsets)
            if cache_key not in archives:
                path = Path(it_dir) / info.relative_path
                if not path.is_file():
                    raise CheckpointError(f"{it_dir}: missing data file {info.relative_path}")
                try:
                    t = read_torch_archive(path, info.offset, info.length)
                except CheckpointError as exc:
                    raise CheckpointError(f"{it_dir}: corrupt chunk {offsets} of {key} ({exc})") from exc
                if not isinstance(t, RawTensor):
                    raise Unsupported(f"{path}: chunk of {key} is not a contiguous tensor")
                archives[cache_key] = t
            return archives[cache_key]

        self.planned = {}
        used: set[str] = set()
        for unit, _ in self.units():
            layer = None if unit in (EMBED, FINAL) else int(unit)
            templates = (self.wmap.first_entries if unit == EMBED else self.wmap.last_entries if unit == FINAL
                         else self.wmap.layer_entries)
            for tmpl in templates:
                entry = tmpl if layer is None else tmpl.format(layer)
                full = megatron_full_shape(entry, shapes, self.cfg, padded)
                key, index = dist_key(tmpl.megatron, layer, tensors)
                meta = tensors.get(key)
                if meta is None:
                    raise CheckpointError(f"{it_dir}: missing tensor {key}")
                used.add(key)
                gshape = tuple(meta.size)
                want = full if index is None else (self.cfg.num_hidden_layers, *full)
                if gshape != tuple(want):
                    raise CheckpointError(f"{it_dir}: tensor {key} has global shape {gshape}, the config implies "
                                          f"{tuple(want)}")
                blocks = []
                for chunk in meta.chunks:
                    offs, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
                    if index is not None and not offs[0] <= index < offs[0] + sizes[0]:
                        continue
                    t = chunk_tensor(key, offs)
                    if tuple(t.shape) != sizes:
                        raise CheckpointError(f"{it_dir}: chunk {offs} of {key} holds {t.shape}, "
                                              f".metadata says {sizes}")
                    if index is not None:
                        t, offs = t.index(index - offs[0]), offs[1:]
                    if len(offs) > 2 and any(offs[2:]):
                        raise Unsupported(f"{key}: chunked beyond dim 1")
                    col = offs[1] * _trailing(full[2:]) if len(offs) > 1 else 0
                    blocks.append(Block(offs[0] if offs else 0, col, t))
                self.planned.update(megatron_entry_ops(entry, blocks, full, self.cfg, str(it_dir)))
        tied = {"output_layer.weight"} if self.cfg.tie_word_embeddings else set()
        unused = sorted(k for k in tensors if k not in used and k not in tied
                        and not k.startswith(("optimizer.", "rng_state", "rerun_state")))
        if unused:
            raise CheckpointError(f"{it_dir}: unused tensor(s) {', '.join(unused[:8])} (not part of a "
                                  f"{self.arch.name} model)")
        self.check_shapes()


def _trailing(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


# ------------------------------------------------------------------------------------------ writing


def plan_hf_files(source: RawSource, max_shard_bytes: int) -> tuple[str, list[FilePlan]]:
    tag = source.dtype()
    units = [(unit, [(n, source.planned[n].shape) for e in entries for n in e.hf]) for unit, entries in source.units()]
    return tag, plan_shards(units, tag, max_shard_bytes)


def hf_tasks(source: RawSource, files: list[FilePlan], tag: str, directory: str, workers: int,
             buffer_bytes: int) -> list[tuple]:
    """Create the output files (headers, final sizes) and cut the copying into tasks of about equal bytes."""
    tasks = []
    for f in files:
        head = header(f, tag)
        size = len(head) + sum(nbytes(shape, tag) for _, shape in f.tensors)
        path = str(Path(directory) / f.name)
        with open(path, "wb") as out:
            out.write(head)
            out.truncate(size)
        offsets = tensor_offsets(f, tag)
        parts = max(1, min(workers, len(f.tensors)) * 2 // max(1, len(files)))
        for lo, hi in split_file_plan(f, parts):
            work = [(offsets[name], source.planned[name].ops) for name, _ in f.tensors[lo:hi]]
            tasks.append((fill_file, (path, work, buffer_bytes)))
    return tasks


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

    def interleave(self, op: Interleave, fd_of) -> None:
        """The rows of ``op``, each read straight into its place (``read_rows``)."""
        width = sum(p[2] for p in op.parts)
        r = 0
        while r < op.rows:
            k = min(op.rows - r, max(1, (self.limit - self.fill) // width))
            read_rows(op.parts, fd_of, r, self.buf[self.fill:self.fill + k * width], width)
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
    per read would fault its pages in every time). Freed with the thread."""
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) < n:
        buf = _buffers.buf = bytearray(n)
    return memoryview(buf)[:n]


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


def read_rows(parts: tuple, fd_of, r: int, block: memoryview, width: int) -> None:
    """Rows ``r .. r + k`` of an interleaved band into ``block`` (``k`` rows of ``width`` bytes, row
    after row): each part's rows are read straight into their columns of the block (``preadv`` with
    one buffer per row), without a copy in this process."""
    k = len(block) // width
    col = 0
    for path, offset, rb, stride in parts:
        fd = fd_of(path)
        start = offset + r * stride
        if rb == width == stride:  # whole rows, one after the other: one read
            preadv_exact(fd, [block], start, path)
        elif stride - rb <= _GAP_READ:  # one read of the whole span; the gaps between rows land in _DISCARD
            rows = row_views(block, k, width, col, rb)
            if stride > rb:
                spans = [_DISCARD[:stride - rb]] * (2 * k - 1)
                spans[::2] = rows
                rows = spans
            preadv_exact(fd, rows, start, path)
        else:  # rows far apart: one read per row
            for i, row in enumerate(row_views(block, k, width, col, rb)):
                preadv_exact(fd, [row], start + i * stride, path)
        col += rb


def open_raw_source(path: str, *, arch: str | None = None, hf_config: str | None = None,
                    vocab_size: int | None = None) -> RawSource:
    """The copy path's view of a checkpoint; ``Unsupported`` where the torch path must read it.

    ``path`` is located as the torch path does (verl actor folders, Megatron-Bridge iterations: see
    ``converters/megatron_sources``); a torch_dist checkpoint without Megatron args is described by
    ``hf_config`` (or the HF config found beside it) and checked against its ``.metadata`` first."""
    from converters.hf_config import read_hf_config
    from converters.megatron_files import hf_config_from_args, resolve_iteration_dir
    from converters.megatron_sources import check_config_against_dist, config_without_args, locate_source

    location = locate_source(path)
    path, hf_config = location.path, hf_config or location.hf_config_dir
    if location.format == "hf":
        return HFRawSource(path, read_hf_config(path))
    if location.format == "megatron":
        return LegacyRawSource(path, arch=arch, hf_config_dir=hf_config, vocab_size=vocab_size)
    it_dir = resolve_iteration_dir(Path(path))
    if not (it_dir / ".metadata").is_file():
        raise Unsupported("torch_dist layout without .metadata")
    common = it_dir / "common.pt"
    data = read_torch_archive(common) if common.is_file() else None
    args = data.get("args") if isinstance(data, dict) else None
    md = read_pickle(it_dir / ".metadata")
    try:
        shapes = {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}
        args_inside = any(getattr(idx, "fqn", None) == "args" for idx in md.storage_data)
    except (AttributeError, TypeError) as exc:
        raise CheckpointError(f"{it_dir}/.metadata: unexpected structure ({exc})") from exc
    if args is None and args_inside:
        raise Unsupported("torch_dist with its args stored as a checkpoint item")
    if args is None:
        config = config_without_args(hf_config, str(it_dir))
    else:
        config = hf_config_from_args(args, arch=arch, hf_config_dir=hf_config, vocab_size=vocab_size,
                                     where=str(it_dir))
    from converters.checkpoint import architecture_for

    model_arch = architecture_for(getattr(config, "model_type", None), path)
    if model_arch.model_config(config).moe is not None:
        raise Unsupported("mixture of experts (the torch path converts it)")
    config_path = f"{hf_config}/config.json" if hf_config else "the config from the Megatron args"
    check_config_against_dist(model_arch.model_config(config), shapes, config_path, str(it_dir))
    source = DistRawSource(str(it_dir), config, path, md, data)
    source.hf_config_dir = hf_config
    return source


def write_hf_by_copy(source: RawSource, directory: str, *, max_shard_bytes: int, workers: int, progress: bool,
                     buffer_bytes: int = DEFAULT_BUFFER) -> None:
    """The HF checkpoint of ``source`` in ``directory`` (safetensors files + index + config + tokenizer)."""
    from converters.safetensors_layout import write_index
    from converters.tasks import run_tasks
    from models.common.hf_files import copy_companion_files

    tag, files = plan_hf_files(source, max_shard_bytes)
    tasks = hf_tasks(source, files, tag, directory, workers, thread_buffer(buffer_bytes, workers))
    run_tasks(tasks, workers, "copying HF shards", progress, threads=True)
    write_index(files, directory, tag)
    config = source.hf_config
    if source.hf_config_dir and source.format != "hf":
        from converters.hf_config import read_hf_config

        config = read_hf_config(source.hf_config_dir)
    if source.hf_config_dir:
        copy_companion_files(source.hf_config_dir, directory)
    config.save(directory, TAG_TO_TORCH_NAME[tag])


__all__ = ["Copy", "Interleave", "Zeros", "RawSource", "HFRawSource", "LegacyRawSource", "DistRawSource", "Unsupported",
           "plan_hf_files", "hf_tasks", "fill_file", "open_raw_source", "write_hf_by_copy", "ITEMSIZE"]
