"""A vLLM ``sharded_state`` directory as a copy-path source: every HF tensor planned as byte ranges of the rank
files, no torch.

The directory is opened by its format's validating reader (``converters/formats/vllm_sharded``: file names, every
header, each rank's keys and shard shapes), the one the torch path's ``VllmReader`` wraps. Which rank holds which
rows of which HF tensor is ``vllm_format.transfers`` asked the other way round: the full HF tensor (every rule at
size 1, the vocabulary unpadded) from the shards of every TP rank (the entry's vLLM rules at the directory's TP).
Rows (dim 0: q/k/v and gate/up blocks, the packed projections of the hybrids, the vocabulary, KV heads replicated
over TP taken from the lowest rank holding them) are contiguous byte ranges of a rank's shard; columns (row-parallel
weights: dim 1) are the rows of every rank's shard side by side (``Interleave``); replicated tensors are rank 0's.
Expert stacks (``w13``/``w2``, ``[E, ...]``) are planned expert by expert. Each weight-map entry is read from the
first pipeline stage that holds it (``VllmShardedCheckpoint.locate``: a vision tower sits on every stage), as the
torch path reads it, so both paths give the same HF tensors.
"""

from __future__ import annotations

from typing import Any

from converters.copy_path.ops import Copy, Interleave, Op, PlannedTensor, Unsupported, merge_copies
from converters.copy_path.raw_source import RawSource
from converters.formats.tensors import ITEMSIZE, RawTensor
from converters.formats.vllm_sharded import VllmShardedCheckpoint, declared_mtp_layers, mtp_not_held_note
from models.common import vllm_format
from models.common.errors import CheckpointError
from models.common.weight_map import WeightEntry, hf_shapes
from parallel.sharding import ShardingError


class VllmRawSource(RawSource):
    """A validated vLLM ``sharded_state`` directory (``VllmShardedCheckpoint``) as planned byte ranges."""

    format = "vllm"

    def __init__(self, checkpoint: VllmShardedCheckpoint, note: bool = True) -> None:
        ckpt = checkpoint
        self.path = ckpt.path
        self._set_model(ckpt)
        self.tp, self.pp = ckpt.tp, ckpt.pp
        declared = declared_mtp_layers(self.hf_config)
        if declared:  # the torch path's VllmReader says the same
            self.notes = [mtp_not_held_note(self.path, declared)]
        if note:
            self.say_notes()
        shapes = hf_shapes(self.cfg, self.wmap)
        self.planned = {}
        for p, stage in enumerate(ckpt.stages):
            for vt in stage:
                if vt.entry is None or vt.entry.hf[0] in self.planned:
                    continue  # a scale scalar; an entry already read from an earlier stage (the tower, tied head)
                shards = [_raw(ckpt.tensors[(p, t)][vt.key]) for t in range(self.tp)]
                self.planned.update(plan_entry(vt.entry, shards, shapes, f"{ckpt.path}: {vt.key}"))
        tag = next(iter(self.planned.values())).dtype
        for name in set(shapes) - set(self.planned):
            if 0 not in shapes[name]:  # the conversion map holds a tensor vLLM's state does not (none known)
                raise Unsupported(f"{self.path}: {name} is not in vLLM's state")
            # a Qwen2-MoE shared expert of width 0: vLLM builds none, transformers holds empty tensors
            self.planned[name] = PlannedTensor(tuple(shapes[name]), tag, [])
        self.planned = {name: self.planned[name] for name in shapes}
        self.check_shapes()


def _raw(stored: Any) -> RawTensor:
    return RawTensor(stored.path, stored.offset, stored.dtype, tuple(stored.shape))


def plan_entry(entry: WeightEntry, shards: list[RawTensor], shapes: dict, where: str) -> dict[str, PlannedTensor]:
    """The HF tensors of ``entry`` from every TP rank's packed shard (``shards[t]``; ``[E, ...]`` stacks for
    expert entries, planned expert by expert)."""
    if entry.experts:
        return _plan_experts(entry, shards, shapes, where)
    size = len(shards)
    full = vllm_format.entry_with_vocab_padding(entry, None)  # the HF tensor: every rule at size 1, unpadded
    try:
        moves = vllm_format.transfers(full, entry.rules, shapes, size, 0, 1)
        bases = _part_rows(entry, shapes, size)
    except ShardingError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    out = {}
    for j, name in enumerate(entry.hf):
        shape = tuple(shapes[name])
        tag = shards[0].dtype
        row = ITEMSIZE[tag]
        for d in shape[1:]:
            row *= d
        mine = sorted((m for m in moves if m.part == j), key=lambda m: m.dst_offset)
        ops: list[Op]
        if len(mine) == 1 and mine[0].dim is None:  # whole on every rank: rank 0's copy
            t = shards[0].rows(bases[0][j], bases[0][j] + shape[0]) if shape else shards[0]
            ops = [Copy(t.path, t.offset, t.nbytes)]
        elif all(m.dim == 0 for m in mine):
            ops = []
            for m in mine:
                rank = max(m.source, 0)
                t = shards[rank].rows(bases[rank][j] + m.src_offset, bases[rank][j] + m.src_offset + m.stop - m.start)
                ops.append(Copy(t.path, t.offset, t.nbytes))
        elif all(m.dim == 1 for m in mine) and len(shape) >= 2:
            col = row // shape[1]
            parts = []
            for m in mine:
                rank = max(m.source, 0)
                s = shards[rank]
                t = s.rows(bases[rank][j], bases[rank][j] + shape[0])
                parts.append((t.path, t.offset + m.src_offset * col, (m.stop - m.start) * col, s.row_nbytes))
            ops = [Interleave(shape[0], tuple(parts))]
        else:
            raise Unsupported(f"{where}: {name} held in pieces along dims {sorted({m.dim for m in mine})}")
        if sum(op.nbytes for op in ops) != _nbytes(shape, tag) or any(m.source == vllm_format.PADDING for m in mine):
            raise CheckpointError(f"{where}: {name} {list(shape)} is not covered by the rank shards")
        out[name] = PlannedTensor(shape, tag, merge_copies(ops))
    return out


def _plan_experts(entry: WeightEntry, shards: list[RawTensor], shapes: dict, where: str) -> dict[str, PlannedTensor]:
    """An ``[E, ...]`` expert stack, expert by expert: expert 0 planned (``plan_entry``), every other expert of the
    same shapes the same operations moved by its offset in each rank's stack (one plan instead of ``E``: planning
    them one by one took ~0.1 s of a 1 GB Qwen3-MoE conversion, a third of ``cp``'s whole time)."""
    first = entry.expert(0)
    template = plan_entry(first, [s.index(0) for s in shards], shapes, f"{where}[0]")
    out = dict(template)
    for e in range(1, entry.experts):
        ex = entry.expert(e)
        stacks = [s.index(e) for s in shards]
        if any(shapes[a] != shapes[b] for a, b in zip(first.hf, ex.hf)) or len({s.path for s in shards}) != len(shards):
            out.update(plan_entry(ex, stacks, shapes, f"{where}[{e}]"))
            continue
        shift = {s.path: s.offset - s0.offset for s, s0 in zip(stacks, (s.index(0) for s in shards))}
        for name, base in zip(ex.hf, first.hf):
            pt = template[base]
            out[name] = PlannedTensor(pt.shape, pt.dtype, [_moved(op, shift) for op in pt.ops])
    return out


def _moved(op: Op, shift: dict[str, int]) -> Op:
    """``op`` reading each file ``shift[path]`` bytes further on."""
    if isinstance(op, Copy):
        return Copy(op.path, op.offset + shift[op.path], op.n)
    if isinstance(op, Interleave):
        return Interleave(op.rows, tuple((p, o + shift[p], rb, st) for p, o, rb, st in op.parts))
    raise CheckpointError(f"internal: an expert planned as {type(op).__name__}")


def _part_rows(entry: WeightEntry, shapes: dict, size: int) -> list[list[int]]:
    """``bases[t][j]``: the first row of part ``j`` in rank ``t``'s packed shard (the parts' shards one after the
    other along dim 0, equal on every rank)."""
    rows, at = [], 0
    for name, rule in zip(entry.hf, entry.rules):
        rows.append(at)
        at += rule.shard_shape(shapes[name], size)[0] if shapes[name] else 0
    return [rows] * size


def _nbytes(shape: tuple[int, ...], tag: str) -> int:
    n = ITEMSIZE[tag]
    for d in shape:
        n *= d
    return n


__all__ = ["VllmRawSource", "plan_entry"]
