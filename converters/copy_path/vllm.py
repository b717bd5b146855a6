"""The copy path's vLLM ``sharded_state`` writer: every rank file laid out from the layout rules and filled
with byte ranges of the source by worker threads -- no torch, no tensor built in memory.

What each rank holds comes from ``models/common/vllm_format.py``, the rules the torch path's writer
(``converters/torch_path/vllm.py``) packs with: ``stage_tensors`` lists a stage's keys in state-dict order
(attention scales included), ``vllm_map`` gives each key's weight-map entry with vLLM's rules (vocabulary padded
to a multiple of 64, KV heads replicated when tp > num_kv_heads, experts fused into ``w13``/``w2`` stacks, the
Gated DeltaNet hybrids' packed projections, a conditional-generation checkpoint's vision tower on every stage).
A rank's shard of an entry is the concatenation along dim 0 of each HF part's ``Piece`` (``parallel/sharding``):
rows of the part (``ops`` of the source's planned HF tensor cut by ``copy_path.megatron_ops.select``), a column
band of every row (row-parallel weights), zero rows past the vocabulary (``Zeros``: a hole in a file created at
its final size); expert stacks are every expert's shard in turn.

The files: parts cut by vLLM's own rule (``vllm_format.split_parts``, the torch path's ``PartSplitter``), each
file's header what ``safetensors.torch.save_file`` writes for those tensors (``sorted_for_safetensors``: the
library orders tensors by dtype, then name), so both paths write the same bytes, file for file. Column bands of
row-parallel weights are read once for all TP ranks (``copy_path.bands.scatter_bands``), everything else by
``copy_path.io.fill_file``. ``config.json`` and the tokenizer files as the torch path writes them
(``formats/hf_config.write_config_dir``).
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

from converters.copy_path.bands import band_scatterable, band_tasks
from converters.copy_path.io import DEFAULT_BUFFER, fill_file, preallocate, thread_buffer
from converters.copy_path.megatron_ops import row_nbytes, select
from converters.copy_path.ops import Data, Op, PlannedTensor, Unsupported, Zeros, merge_copies
from converters.copy_path.raw_source import RawSource
from converters.formats.hf import nbytes, stored_header, stored_offsets
from converters.formats.hf_config import read_hf_config, write_config_dir
from converters.formats.tensors import TAG_TO_TORCH_NAME
from converters.formats.vllm_sharded import mtp_not_written_note
from converters.runtime.tasks import run_tasks
from models.common import vllm_format
from models.common.errors import CheckpointError
from models.common.weight_map import WeightEntry
from parallel.sharding import ShardingError, Split

# safetensors orders a file's tensors by dtype, larger ranks first (its Dtype enum), then by name
SAFETENSORS_DTYPE_RANK = {"BOOL": 0, "U8": 1, "I8": 2, "I16": 3, "F16": 4, "BF16": 5, "I32": 6, "F32": 7, "F64": 8,
                          "I64": 9}
WEIGHT_TAGS = ("F32", "BF16", "F16", "F64")  # the dtypes the copy path writes vLLM weights in
ONE_F32 = struct.pack("<f", 1.0)  # every attention scale: 1.0 as a little-endian float32
SCALE_TAG = "F32"


@dataclass
class RankTensor:
    """One tensor of a rank file: its key, shape, dtype tag and the operations producing its bytes; ``bands``:
    ``(group, byte offset in the tensor)`` of each piece written instead by ``scatter_bands`` (one read of the full
    rows for every TP rank: a row-parallel weight, or each expert's of a ``w2`` stack)."""

    key: str
    shape: tuple[int, ...]
    tag: str
    ops: list[Op]
    bands: list[tuple[int, int]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.tag)


@dataclass
class VllmCopyTarget:
    """What ``write_vllm_by_copy`` writes: ``ranks[(pp_rank, tp_rank)]``, each rank's tensors in state-dict
    order; ``bands[group]``: (full-row operations, row bytes) of a row-parallel weight scattered over TP."""

    tp: int
    pp: int
    tag: str
    ranks: dict[tuple[int, int], list[RankTensor]]
    bands: dict[int, tuple[list[Op], int]] = field(default_factory=dict)


def plan_vllm_target(source: RawSource, *, tp: int, pp: int) -> VllmCopyTarget:
    """Check the layout as the torch path does (``check_layout``: VllmLayoutError; ``check_hf_config``:
    CheckpointError naming the source), then plan every rank's tensors as operations on the source files;
    ``Unsupported`` (the torch path writes it) for a dtype or a piece this writer does not cut."""
    cfg = source.cfg
    vllm_format.check_layout(cfg, tp, pp)
    try:
        vllm_format.check_hf_config(source.hf_config, cfg, tp)
    except vllm_format.VllmLayoutError as exc:
        raise CheckpointError(f"{source.path}: {exc}") from None
    tag = source.dtype()
    if tag not in WEIGHT_TAGS:
        raise Unsupported(f"{source.path}: vLLM weights in {tag}")
    vmap = vllm_format.vllm_map(source.arch, cfg)
    target = VllmCopyTarget(tp, pp, tag, {})
    band_of: dict[tuple, int] = {}  # (stage, first HF name) -> its band group (a tower is on every stage)
    for p in range(pp):
        wanted = vllm_format.stage_tensors(vmap, cfg, p, pp)
        for t in range(tp):
            tensors = []
            for vt in wanted:
                if vt.entry is None:  # an attention scale scalar, 1.0 in fp32
                    tensors.append(RankTensor(vt.key, (), SCALE_TAG, [Data(ONE_F32)]))
                    continue
                tensors.append(_rank_tensor(source, target, vt.key, vt.entry, p, t, tag, band_of))
            target.ranks[(p, t)] = tensors
    return target


def _rank_tensor(source: RawSource, target: VllmCopyTarget, key: str, entry: WeightEntry, p: int, t: int, tag: str,
                 band_of: dict[tuple, int]) -> RankTensor:
    """Rank ``t``'s packed shard of ``entry`` under ``key``; at TP > 1 a row-parallel weight (each expert of a
    stack, for ``w2``) is a band of the full rows, read once for every rank (``target.bands``)."""
    tp = target.tp
    names = entry.expert_hf(0) if entry.experts else entry.hf
    shapes = {n: source.planned[n].shape for n in names}
    try:
        shape = vllm_format.shard_shape(entry, shapes, tp)
    except ShardingError as exc:
        raise CheckpointError(f"{source.path}: {key}: {exc}") from None
    experts = [entry.expert(e) for e in range(entry.experts)] if entry.experts else [entry]
    if all(_band_source(source, one, tp) is not None for one in experts):
        each = nbytes(shape, tag) // len(experts)
        bands = []
        for e, one in enumerate(experts):
            group = band_of.setdefault((p, one.hf[0]), len(band_of))
            if group not in target.bands:
                target.bands[group] = _band_source(source, one, tp)
            bands.append((group, e * each))
        return RankTensor(key, shape, tag, [], bands)
    ops = _entry_ops(source, entry, t, tp)
    if sum(op.nbytes for op in ops) != nbytes(shape, tag):
        raise CheckpointError(f"internal: {key} planned as {sum(op.nbytes for op in ops)} bytes, its shard "
                              f"{list(shape)} takes {nbytes(shape, tag)}")
    return RankTensor(key, shape, tag, ops)


def _band_source(source: RawSource, entry: WeightEntry, tp: int) -> tuple[list[Op], int] | None:
    """(full-row operations, row bytes) of a single-part ``Split(1)`` weight of two or more dims (``o_proj``,
    ``down_proj``, ``out_proj``, one expert's ``w2``, the tower's ``proj`` / ``linear_fc2``) at TP > 1:
    ``scatter_bands`` writes band t of every row to rank t's file, reading each source row once; None otherwise."""
    if tp == 1 or entry.experts or len(entry.hf) != 1 or not isinstance(entry.rules[0], Split):
        return None
    pt = source.planned[entry.hf[0]]
    if entry.rules[0].dim != 1 or len(pt.shape) < 2 or not band_scatterable(pt.ops):
        return None
    if pt.shape[1] % tp:
        return None  # shard_shape refused it already
    return list(pt.ops), row_nbytes(pt.shape, pt.dtype)


def _entry_ops(source: RawSource, entry: WeightEntry, rank: int, size: int) -> list[Op]:
    """Operations producing rank ``rank``'s packed shard of ``entry`` (``vllm_format.pack_shard`` in bytes)."""
    if entry.experts:
        ops: list[Op] = []
        for e in range(entry.experts):
            ops += _entry_ops(source, entry.expert(e), rank, size)
        return merge_copies(ops)
    ops = []
    for name, rule in zip(entry.hf, entry.rules):
        pt = source.planned[name]
        try:
            piece = rule.piece(pt.shape, rank, size)
        except ShardingError as exc:
            raise CheckpointError(f"{source.path}: {name}: {exc}") from None
        ops += _piece_ops(pt, piece, name)
    return merge_copies(ops)


def _piece_ops(pt: PlannedTensor, piece, name: str) -> list[Op]:
    """Operations producing ``piece`` of the planned HF tensor ``pt`` (``parallel.sharding.read_piece``'s
    bytes): the whole tensor, ranges of rows (zero rows past its end), or one column band of every row."""
    if piece.dim is None:
        return list(pt.ops)
    width = row_nbytes(pt.shape, pt.dtype)
    length = pt.shape[piece.dim]
    ops: list[Op] = []
    if piece.dim == 0:
        for a, b, _ in piece.ranges(length):
            hi = min(b, length)
            if a < hi:
                ops += _select(pt, a, hi, 0, width)
            pad = b - max(a, length)
            if pad > 0:  # vocabulary padding: zero rows
                ops.append(Zeros(pad * width))
        return ops
    ranges = piece.ranges(length)
    if piece.dim == 1 and len(ranges) == 1 and ranges[0][1] <= length:
        a, b, _ = ranges[0]
        col = width // length
        return _select(pt, 0, pt.shape[0], a * col, b * col)
    raise Unsupported(f"{name}: a shard along dim {piece.dim} in {len(ranges)} ranges")


def _select(pt: PlannedTensor, r0: int, r1: int, b0: int, b1: int) -> list[Op]:
    """``megatron_ops.select``, and the same cut of bytes computed while planning (``Data``: a hybrid's output
    norm from a Megatron source)."""
    if not any(isinstance(op, Data) for op in pt.ops):
        return select(pt, r0, r1, b0, b1)
    if not all(isinstance(op, Data) for op in pt.ops):
        raise Unsupported(f"a tensor {list(pt.shape)} of computed and stored bytes")
    data = b"".join(op.data for op in pt.ops)
    width = row_nbytes(pt.shape, pt.dtype)
    return [Data(b"".join(data[r * width + b0:r * width + b1] for r in range(r0, r1)))]


# ------------------------------------------------------------------------------------------------ writing


def sorted_for_safetensors(tensors: list[RankTensor]) -> list[RankTensor]:
    """A file's tensors in the order ``safetensors.torch.save_file`` stores them: dtype (its enum, the larger
    first), then name."""
    return sorted(tensors, key=lambda x: (-SAFETENSORS_DTYPE_RANK[x.tag], x.key))


@dataclass
class _File:
    path: str
    size: int
    head: bytes
    work: list[tuple[int, list[Op], int]]  # (offset, ops, bytes)


def _lay_out(target: VllmCopyTarget, directory: str, max_shard_bytes: int,
             outputs: dict[int, list]) -> list[_File]:
    """Every rank's part files (names, headers, sizes) and where each tensor's bytes go; the band tensors'
    places are recorded in ``outputs[group][t]`` for ``scatter_bands``."""
    files = []
    for (p, t), tensors in sorted(target.ranks.items()):
        parts = vllm_format.split_parts([x.nbytes for x in tensors], max_shard_bytes)
        for k in range(max(parts, default=-1) + 1):
            chosen = sorted_for_safetensors([x for x, part in zip(tensors, parts) if part == k])
            stored = [(x.key, x.shape, x.tag) for x in chosen]
            head = stored_header(stored)
            offsets = stored_offsets(stored)
            path = str(Path(directory) / vllm_format.vllm_file_name(t, k, p, target.pp))
            work = []
            for x in chosen:
                for group, at in x.bands:
                    outputs.setdefault(group, [None] * target.tp)[t] = (path, offsets[x.key] + at)
                if not x.bands and x.nbytes:
                    work.append((offsets[x.key], x.ops, x.nbytes))
            files.append(_File(path, len(head) + sum(x.nbytes for x in chosen), head, work))
    return files


def _tasks(files: list[_File], target: VllmCopyTarget, outputs: dict[int, list], workers: int,
           buffer_bytes: int) -> list[tuple]:
    """Fill tasks of about equal bytes, round-robin over the files (workers at the same time write different
    files), then ``scatter_bands`` tasks for the row-parallel weights (``band_tasks``)."""
    total = sum(n for f in files for *_, n in f.work) + sum(op.nbytes for ops, _ in target.bands.values()
                                                            for op in ops)
    share = max(1, total // max(1, 2 * workers))
    per_file = []
    for f in files:
        tasks, batch, acc = [], [], 0
        for off, ops, n in f.work:
            batch.append((off, ops))
            acc += n
            if acc >= share:
                tasks.append((fill_file, (f.path, batch, buffer_bytes)))
                batch, acc = [], 0
        if batch:
            tasks.append((fill_file, (f.path, batch, buffer_bytes)))
        per_file.append(tasks)
    ordered = []
    for i in range(max(map(len, per_file), default=0)):
        ordered += [tasks[i] for tasks in per_file if i < len(tasks)]
    return ordered + band_tasks([(ops, width, outputs[group]) for group, (ops, width) in sorted(target.bands.items())],
                                buffer_bytes)


def write_vllm_by_copy(source: RawSource, target: VllmCopyTarget, directory: str, *, max_shard_bytes: int,
                       workers: int, progress: bool, files_from: str | None,
                       buffer_bytes: int = DEFAULT_BUFFER) -> None:
    """Every rank's ``sharded_state`` files of ``source`` in ``directory``, then config.json and the tokenizer
    files (from ``files_from``, an HF directory, else the source's config), as the torch path writes them. A
    hybrid's MTP block is not written (vLLM's main model holds none), with the torch path's note on stderr."""
    mtp = getattr(source.wmap, "mtp_layers", 0)
    if mtp:
        print(mtp_not_written_note(source.path, mtp), file=sys.stderr)
    outputs: dict[int, list] = {}
    files = _lay_out(target, directory, max_shard_bytes, outputs)
    for f in files:
        with open(f.path, "wb") as out:  # a Python file object: a failed write keeps its errno
            out.write(f.head)
            out.truncate(f.size)
            preallocate(out.fileno(), f.size)  # blocks allocated now: the copy fills them (io.preallocate)
    tasks = _tasks(files, target, outputs, workers, thread_buffer(buffer_bytes, workers))
    run_tasks(tasks, workers, "copying vLLM shards", progress, threads=True)
    config = read_hf_config(files_from) if files_from else source.hf_config
    write_config_dir(config, directory, TAG_TO_TORCH_NAME[target.tag])


__all__ = ["VllmCopyTarget", "plan_vllm_target", "write_vllm_by_copy", "sorted_for_safetensors"]
