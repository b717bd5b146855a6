"""Live export of a running parallel model as flat buckets of full HF tensors (any tp/pp/vpp/dp/fsdp).

``iter_export(model, format="hf", bucket_bytes=..., dtype=None)`` is a collective iterator: every
rank of the job calls it and receives the same sequence of ``ExportBucket``s, each one contiguous
buffer of one dtype plus the names, shapes and offsets of the HF tensors in it (``.tensors()``
gives ``(name, view)`` pairs; a receiver can hand the buffer to an inference engine in one copy).

How a bucket is built: the bucket plan is pure arithmetic on the config and the layout (the same
on every rank). A bucket only holds tensors of one pipeline stage; that stage's ranks gather each
parameter over TP and merge it with the weight map's sharding rules (``export_hf_state``; the same
entries and rules that loading and the converters use) into the bucket buffer, then the buffer is
broadcast from that stage to the other stages over the PP group. Every data-parallel replica
(dp/cp/ulysses ranks) does this on its own, so each tensor crosses the job once per receiving rank
and no DP traffic is needed - except under FSDP2, where a parameter is first un-sharded over the
replica mesh (``full_tensor``). Tied embeddings appear once, as HF stores them. Per rank, memory
beyond the model is the bucket being filled plus one parameter in flight (its gathered TP
shards and the merged tensors; under FSDP2 also its un-sharded copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from models.common import vllm_format
from models.common.weights import WeightEntry, export_hf_state, hf_shapes
from parallel.fsdp import unshard
from parallel.pipeline_layout import stage_layer_ranges

FORMATS = ("hf", "vllm")
TRANSPORTS = ("collective", "shm")
DEFAULT_BUCKET_BYTES = 512 << 20


class ExportError(ValueError):
    """An export that cannot be done as asked (numbers and names given); raised before any collective."""


@dataclass(frozen=True)
class TensorMeta:
    """Where one HF tensor sits in a bucket's buffer: elements ``[offset, offset + numel)``."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BucketPlan:
    """One bucket: the weight-map entries of pipeline stage ``stage`` it gathers, and their tensors."""

    stage: int
    entries: tuple[WeightEntry, ...]
    metas: tuple[TensorMeta, ...]
    numel: int


@dataclass
class ExportBucket:
    """A flat ``buffer`` (one dtype) holding the full HF tensors described by ``metas``."""

    buffer: torch.Tensor
    metas: tuple[TensorMeta, ...]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` views into the buffer (no copies)."""
        return [(m.name, self.buffer[m.offset:m.offset + m.numel].view(m.shape)) for m in self.metas]


def _hf_items(model, stage_entries: list[WeightEntry]) -> list[tuple[WeightEntry, list[tuple[str, tuple[int, ...]]]]]:
    shapes = hf_shapes(model.config, model.weight_map)
    return [(entry, [(name, tuple(shapes[name])) for name in entry.hf]) for entry in stage_entries]


def _stage_entries(model) -> list[list[WeightEntry]]:
    """The weight-map entries each training pipeline stage owns (all layers of its virtual chunks)."""
    cfg, groups = model.config, model.groups
    ranges = stage_layer_ranges(cfg.num_hidden_layers, groups.config)
    return [model.weight_map.entries(sorted(i for r in chunks for i in r), first=stage == 0,
                                     last=stage == groups.pp_size - 1) for stage, chunks in enumerate(ranges)]


def _vllm_items(model, target_tp: int) -> list[list[tuple[WeightEntry, list[tuple[str, tuple[int, ...]]]]]]:
    """Per training stage: (vLLM entry, [(vLLM key, shard shape at target_tp)]) for the tensors it owns."""
    cfg = model.config
    vmap = vllm_format.vllm_weight_map(model.weight_map, cfg)
    shapes = hf_shapes(cfg, vmap)
    owner = {e.param: stage for stage, entries in enumerate(_stage_entries(model)) for e in entries}
    items: list[list] = [[] for _ in range(model.groups.pp_size)]
    for t in vllm_format.stage_tensors(vmap, cfg, 0, 1, scales=False, head_alias=False):
        items[owner[t.entry.param]].append((t.entry, [(t.key, vllm_format.shard_shape(t.entry, shapes, target_tp))]))
    return items


def plan_buckets(model, bucket_bytes: int, element_size: int, format: str = "hf",
                 target_tp: int = 1) -> list[BucketPlan]:
    """Buckets in export order (stage by stage, in the weight map's order within a stage).

    A bucket holds whole parameters (all HF tensors packed into one parameter travel together) of
    one stage, at most ``bucket_bytes`` - except a single parameter larger than that, which gets a
    bucket of its own. ``format="vllm"``: one tensor per parameter, vLLM rank shards at ``target_tp``.
    """
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ExportError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    if format == "vllm":
        per_stage = _vllm_items(model, target_tp)
    else:
        per_stage = [_hf_items(model, entries) for entries in _stage_entries(model)]
    plans: list[BucketPlan] = []
    for stage, items in enumerate(per_stage):
        current: list[WeightEntry] = []
        metas: list[TensorMeta] = []
        offset = 0
        for entry, tensors in items:
            numel = sum(math.prod(shape) for _, shape in tensors)
            if current and (offset + numel) * element_size > bucket_bytes:
                plans.append(BucketPlan(stage, tuple(current), tuple(metas), offset))
                current, metas, offset = [], [], 0
            for name, shape in tensors:
                metas.append(TensorMeta(name, shape, offset))
                offset += metas[-1].numel
            current.append(entry)
        if current:
            plans.append(BucketPlan(stage, tuple(current), tuple(metas), offset))
    return plans


class _Unsharded(dict):
    """Parameters by internal name, FSDP2 shards gathered back to this TP rank's tensor on access."""

    def __getitem__(self, name: str) -> torch.Tensor:
        return unshard(super().__getitem__(name))


def _source_tensors(model, merge_lora: bool) -> dict:
    """Internal name -> tensor to export: the parameters, or with ``merge_lora`` the LoRA-merged weights."""
    if merge_lora:
        if getattr(model, "lora_config", None) is None:
            raise ExportError("merge_lora=True but the model has no LoRA adapter")
        from models.common.lora import MergedParameters

        return MergedParameters(model)
    return _Unsharded(model.named_parameters())


def _check_export_args(model, format, target_tp, target_rank, bucket_bytes) -> None:
    if format not in FORMATS:
        raise ExportError(f"unknown export format {format!r} (choose {', '.join(FORMATS)})")
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
        raise ExportError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    if format == "hf":
        if target_tp is not None or target_rank is not None:
            raise ExportError("target_tp/target_rank apply to format='vllm' only (HF tensors are whole)")
        return
    if target_tp is None or target_rank is None:
        raise ExportError("format='vllm' needs target_tp (the vLLM engine's TP) and target_rank (its rank)")
    try:
        vllm_format.check_layout(model.config, target_tp)
    except vllm_format.VllmLayoutError as exc:
        raise ExportError(str(exc)) from None
    if not isinstance(target_rank, int) or isinstance(target_rank, bool) or not 0 <= target_rank < target_tp:
        raise ExportError(f"target_rank={target_rank!r} is out of range for target_tp={target_tp}")


@torch.no_grad()
def iter_export(model, format: str = "hf", *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                dtype: torch.dtype | None = None, merge_lora: bool = False, target_tp: int | None = None,
                target_rank: int | None = None, transport: str = "collective") -> Iterator[ExportBucket]:
    """Collective over every rank: yields the same ``ExportBucket``s everywhere (see module doc).

    ``format="hf"``: full tensors under HF names. ``format="vllm"``: the shards vLLM rank
    ``target_rank`` of an engine with TP ``target_tp`` holds, under vLLM's parameter names (any
    ``target_tp`` the heads, KV heads, MLP width and vLLM's padded vocabulary divide into; it need
    not equal the training TP); each shard is assembled from only the training shards that overlap
    it. ``dtype``: the exported dtype (default: the parameters'); ``merge_lora``: weights with the
    LoRA adapter merged in (the adapter alone: ``lora_state``). Arguments are checked and agreed on
    by every rank before any data moves (ExportError on every rank otherwise). Every rank must
    iterate to the end.

    ``transport="collective"`` (default): buckets are gathered with TP collectives and broadcast
    over PP; each rank gets its own buffer, valid as long as it is kept. ``transport="shm"`` (one
    host, CPU tensors): every rank of the owning stage's first replica writes its own rows straight
    into a bucket in shared memory (``/dev/shm``, unlinked at once) that every rank reads in place -
    one copy per byte in the whole job, no process-to-process traffic. Its buffers are views into
    two rotating segments: a bucket is valid until the next one is requested (clone it to keep it).
    """
    failure = _Failure()
    failure.run(_check_export_args, model, format, target_tp, target_rank, bucket_bytes)
    if merge_lora and getattr(model, "lora_config", None) is None:
        failure.run(_raise, "merge_lora=True but the model has no LoRA adapter")
    if transport not in TRANSPORTS:
        failure.run(_raise, f"unknown transport {transport!r} (choose {', '.join(TRANSPORTS)})")
    problem = failure.agree(same=(format, target_tp, target_rank, bucket_bytes, str(dtype), merge_lora, transport))
    if problem:
        raise ExportError(f"iter_export: {problem}")
    if transport == "shm":
        from parallel.shared_memory import single_host

        if not single_host():
            raise ExportError("iter_export: transport='shm' needs every rank on one host with /dev/shm")
    groups = model.groups
    params = list(model.parameters())
    dtype = dtype or params[0].dtype
    device = params[0].device if params[0].device.type != "meta" else None
    element_size = torch.empty((), dtype=dtype).element_size()
    plans = plan_buckets(model, bucket_bytes, element_size, format, target_tp or 1)
    shapes = hf_shapes(model.config, model.weight_map)
    named = _source_tensors(model, merge_lora)
    shared = _open_shared(model, plans, element_size, device) if transport == "shm" else None
    for index, plan in enumerate(plans):
        if shared is not None:
            buffer = shared.segment(index % 2, dtype, plan.numel)
            if groups.pp_rank == plan.stage:
                _fill_shared(_plan_moves(buffer, plan, named, model, format, target_tp, target_rank), groups)
            if dist.is_initialized():
                dist.barrier()  # the bucket is complete for every reader
            yield ExportBucket(buffer, plan.metas)
            continue
        buffer = torch.empty(plan.numel, dtype=dtype, device=device)
        if groups.pp_rank == plan.stage:
            if format == "vllm":
                moves = _plan_moves(buffer, plan, named, model, format, target_tp, target_rank)
                _fill_by_broadcast(buffer, moves, groups)
            else:
                positions = {m.name: m for m in plan.metas}
                for name, full in export_hf_state(named, list(plan.entries), shapes, groups.tp_group):
                    meta = positions[name]
                    buffer[meta.offset:meta.offset + meta.numel].copy_(full.reshape(-1))
        if groups.pp_size > 1:
            dist.broadcast(buffer, src=dist.get_global_rank(groups.pp_group, plan.stage), group=groups.pp_group)
        yield ExportBucket(buffer, plan.metas)


def _open_shared(model, plans: list[BucketPlan], element_size: int, device):
    """Two shared segments (double buffering: bucket k is written while readers may still hold k-1),
    kept on the model for the next export (an RL job exports every step; fresh segments would pay
    their page faults again) and replaced when a larger bucket is asked for. The decision depends
    only on the plan, so every rank makes it alike."""
    from parallel.shared_memory import SharedSegments

    if device is not None and device.type != "cpu":
        raise ExportError(f"transport='shm' needs CPU tensors (the model is on {device})")
    needed = max((p.numel for p in plans), default=1) * element_size
    shared = getattr(model, "_export_segments", None)
    if shared is None or shared.nbytes < needed:
        if shared is not None:
            shared.close()
        shared = model._export_segments = SharedSegments(2, needed)
    return shared


@dataclass
class _Move:
    """Copy ``src`` (held by training TP rank ``source``; -1: by every rank) into ``dst`` (a view of the
    bucket); ``source`` ``vllm_format.PADDING``: zero ``dst``."""

    source: int
    dst: torch.Tensor
    src: torch.Tensor | None  # None on ranks that do not hold it


def _plan_moves(buffer: torch.Tensor, plan: BucketPlan, named, model, format: str, target_tp: int,
                target_rank: int) -> list[_Move]:
    """Which rows of which training TP rank's shards land where in the bucket, from the rules alone.

    HF buckets hold full tensors (the target is "TP 1": one region per HF tensor); vLLM buckets
    hold rank ``target_rank``'s packed shards at ``target_tp``. A row held by several ranks
    (replicated KV heads) comes from the lowest; replicated tensors from every rank's own copy.
    """
    groups = model.groups
    tp, me = groups.tp_size, groups.tp_rank
    shapes = hf_shapes(model.config, model.weight_map)
    src_entries = {e.param: e for e in model.weight_map.entries(model.layer_ids(), first=model.is_first_stage,
                                                                 last=model.is_last_stage)}
    dst_size, dst_rank = (target_tp, target_rank) if format == "vllm" else (1, 0)
    by_name = {m.name: m for m in plan.metas}

    def region(tensor: torch.Tensor, row0: int, rows: int, dim: int | None, offset: int, length: int) -> torch.Tensor:
        part = tensor.narrow(0, row0, rows)
        return part if dim is None else part.narrow(dim, offset, length)

    moves = []
    for i, entry in enumerate(plan.entries):
        src_entry = src_entries[entry.param]
        local = named[entry.param]
        src_rows = [rule.shard_shape(shapes[n], tp)[0] for n, rule in zip(src_entry.hf, src_entry.rules)]
        if len(entry.hf) == 1:  # unpacked: the whole shard is the part (row-parallel splits along dim 1)
            src_rows = [local.shape[0]]
        if format == "vllm":
            meta = plan.metas[i]
            packed = buffer[meta.offset:meta.offset + meta.numel].view(meta.shape)
            rows = [rule.shard_shape(shapes[n], dst_size)[0] for n, rule in zip(entry.hf, entry.rules)]
            if len(entry.hf) == 1:
                rows = [meta.shape[0]]
            targets = [(packed, sum(rows[:k]), rows[k]) for k in range(len(rows))]
        else:
            targets = []
            for name in entry.hf:
                meta = by_name[name]
                targets.append((buffer[meta.offset:meta.offset + meta.numel].view(meta.shape), 0, meta.shape[0]))
        dst_entry = entry if format == "vllm" else vllm_format.entry_with_vocab_padding(entry, None)
        for move in vllm_format.transfers(dst_entry, src_entry.rules, shapes, tp, dst_rank, dst_size):
            target, d0, d_rows = targets[move.part]
            n = move.stop - move.start
            dst = region(target, d0, d_rows, move.dim, move.dst_offset, n)
            s0 = sum(src_rows[:move.part])
            if move.source == vllm_format.PADDING:
                moves.append(_Move(move.source, dst, None))
                continue
            held = move.source < 0 or move.source == me
            src = region(local, s0, src_rows[move.part], move.dim, move.src_offset, n) if held else None
            moves.append(_Move(move.source, dst, src))
    return moves


def _fill_by_broadcast(buffer: torch.Tensor, moves: list[_Move], groups) -> None:
    """Collective transport: each training TP rank sends its rows of the bucket in one broadcast."""
    tp, me = groups.tp_size, groups.tp_rank
    per_source: list[list[_Move]] = [[] for _ in range(tp)]
    for m in moves:
        if m.source == vllm_format.PADDING:
            m.dst.zero_()
        elif m.source < 0:
            m.dst.copy_(m.src)
        else:
            per_source[m.source].append(m)
    for source, items in enumerate(per_source):
        if not items:
            continue
        sizes = [m.dst.numel() for m in items]
        if source == me:
            flat = torch.cat([m.src.to(buffer.dtype).reshape(-1) for m in items])
        else:
            flat = torch.empty(sum(sizes), dtype=buffer.dtype, device=buffer.device)
        if tp > 1:
            dist.broadcast(flat, src=dist.get_global_rank(groups.tp_group, source), group=groups.tp_group)
        for m, piece in zip(items, torch.split(flat, sizes)):
            m.dst.copy_(piece.view(m.dst.shape))


def _fill_shared(moves: list[_Move], groups) -> None:
    """Shared-memory transport: each rank of the first replica writes its own rows straight into the
    shared bucket (replicated tensors: TP rank 0). No bytes move between processes otherwise."""
    if not _first_replica(groups):
        return
    for m in moves:
        if m.source == vllm_format.PADDING:
            if groups.tp_rank == 0:
                m.dst.zero_()
        elif m.source == groups.tp_rank or (m.source < 0 and groups.tp_rank == 0):
            m.dst.copy_(m.src)


def _file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


CAUSAL_LM_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class _Failure:
    """Collects a rank's error so that all ranks learn of it together (no rank left waiting)."""

    def __init__(self) -> None:
        self.message: str | None = None

    def run(self, fn, *args, **kwargs):
        if self.message is None:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - reported to every rank by agree()
                self.message = f"{type(exc).__name__}: {exc}"
        return None

    def agree(self, same=None) -> str | None:
        """Collective: the first failing rank's message on every rank (None when all succeeded).

        ``same``: a value every rank must have passed identically (e.g. the call's arguments);
        a rank that differs from rank 0 counts as failed."""
        if not dist.is_initialized():
            return self.message
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, (self.message, same))
        failed = [(r, m) for r, (m, _) in enumerate(flags) if m is not None]
        failed += [(r, f"called with {v!r}, rank 0 with {flags[0][1]!r} (every rank must pass the same arguments)")
                   for r, (m, v) in enumerate(flags) if m is None and v != flags[0][1]]
        failed.sort()
        return f"rank {failed[0][0]}: {failed[0][1]}" if failed else None


def _check_destination(target) -> None:
    import os
    from pathlib import Path

    target = Path(target)
    if target.exists():
        raise ExportError(f"{target}: already exists (choose a new directory; nothing was written)")
    if not target.parent.is_dir():
        raise ExportError(f"{target.parent}: the parent directory does not exist")
    if not os.access(target.parent, os.W_OK):
        raise ExportError(f"{target.parent}: not writable")


def _saved_config(hf_config, dtype: torch.dtype):
    """A copy of the config recording the stored dtype (``dtype`` on transformers 5, ``torch_dtype``
    before) and the model class (vLLM and SGLang read ``architectures``)."""
    import copy

    saved = copy.deepcopy(hf_config)
    if isinstance(getattr(type(saved), "torch_dtype", None), property):
        saved.dtype = dtype
    else:
        saved.torch_dtype = dtype
    if not getattr(saved, "architectures", None) and saved.model_type in CAUSAL_LM_CLASSES:
        saved.architectures = [CAUSAL_LM_CLASSES[saved.model_type]]
    return saved


class _StagedDirectory:
    """A collective write into a temporary sibling ``.<name>.pmz-tmp-<id>`` that global rank 0 renames
    to ``target`` at the end; any rank's failure is agreed on by all ranks, the temporary directory
    is removed and every rank raises ``ExportError`` naming the failing rank. Stale temporary
    directories of earlier killed runs are removed first."""

    def __init__(self, target, what: str) -> None:
        import uuid
        from pathlib import Path

        self.target, self.what = Path(target), what
        self.failure = _Failure()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        name = [f".{self.target.name}.pmz-tmp-{uuid.uuid4().hex[:12]}"]
        if dist.is_initialized():
            dist.broadcast_object_list(name, src=0)
        self.tmp = self.target.parent / name[0]

    def check(self, *checks) -> None:
        """Run ``(fn, *args)`` checks on every rank and agree (before anything is written)."""
        self.failure.run(_check_destination, self.target)
        for fn, *args in checks:
            self.failure.run(fn, *args)
        self.raise_if_failed()

    def open(self) -> None:
        import shutil

        def prepare() -> None:
            for stale in self.target.parent.glob(f".{self.target.name}.pmz-tmp-*"):
                shutil.rmtree(stale)
            self.tmp.mkdir()
            self.tmp.chmod(0o755)

        if self.rank == 0:
            self.failure.run(prepare)
        self.raise_if_failed()

    def run(self, fn, *args, **kwargs):
        """Run a write step on this rank; a failure is reported at the next agreement."""
        return self.failure.run(fn, *args, **kwargs)

    def commit(self, finish) -> None:
        """Agree that every rank's files are written, let rank 0 run ``finish(tmp)`` and rename."""
        import os

        def done() -> None:
            finish(self.tmp)
            if self.target.exists():
                raise ExportError(f"{self.target}: appeared while saving (left untouched)")
            os.rename(self.tmp, self.target)

        if self.failure.agree() is None and self.rank == 0:
            self.failure.run(done)
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        import shutil

        problem = self.failure.agree()
        if problem:
            if self.rank == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise ExportError(f"{self.what}({self.target}): {problem}")


def _check_saveable(model, merge_lora: bool) -> None:
    if getattr(model, "hf_config", None) is None:
        raise ExportError("the model has no transformers config to save (build it with build_parallel_model)")
    if merge_lora and getattr(model, "lora_config", None) is None:
        raise ExportError("merge_lora=True but the model has no LoRA adapter")


def _parse_shard_size(max_shard_size) -> int:
    from models.common.sizes import parse_size

    limit = parse_size(max_shard_size)
    if limit < 1:
        raise ExportError(f"max_shard_size={max_shard_size!r} must be positive")
    return limit


def save_pretrained(model, directory, *, dtype: torch.dtype | None = None, max_shard_size: str | int = "5GB",
                    merge_lora: bool = False) -> None:
    """Collective over every rank: write an HF checkpoint directory that transformers loads unchanged.

    Files are planned from the config alone (the same on every rank); each file holds tensors of one
    pipeline stage and is written once, by one TP rank of that stage's first replica (files dealt
    round-robin over the TP ranks), from tensors gathered over TP (ranks that do not write drop
    them as they come). Atomic and failure-agreeing (``_StagedDirectory``): no half-written
    ``directory``, no rank left waiting. Needs a filesystem every writing rank sees at the same path.
    """
    import json

    from safetensors.torch import save_file

    staged = _StagedDirectory(directory, "save_pretrained")
    staged.check((_check_saveable, model, merge_lora))
    limit = _parse_shard_size(max_shard_size)
    hf_config = model.hf_config
    groups = model.groups
    dtype = dtype or next(model.parameters()).dtype
    element_size = torch.empty((), dtype=dtype).element_size()
    plans = plan_buckets(model, limit, element_size)
    names = _file_names(len(plans))
    staged.open()
    shapes = hf_shapes(model.config, model.weight_map)
    named = _source_tensors(model, merge_lora)
    for index, (plan, file_name) in enumerate(zip(plans, names)):
        if groups.pp_rank != plan.stage:
            continue
        writer = _first_replica(groups) and groups.tp_rank == index % groups.tp_size
        tensors = {}
        for name, full in export_hf_state(named, list(plan.entries), shapes, groups.tp_group):
            if writer:
                tensors[name] = full.to(device="cpu", dtype=dtype).contiguous()
        if writer:
            staged.run(save_file, tensors, str(staged.tmp / file_name), metadata={"format": "pt"})
        del tensors

    def finish(tmp) -> None:
        _saved_config(hf_config, dtype).save_pretrained(str(tmp))
        _copy_source_files(model, tmp)
        if len(plans) > 1:
            index = {"metadata": {"total_size": sum(p.numel for p in plans) * element_size},
                     "weight_map": {m.name: file_name for plan, file_name in zip(plans, names) for m in plan.metas}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    staged.commit(finish)


def _first_replica(groups) -> bool:
    return groups.dp_rank == 0 and groups.cp_rank == 0 and groups.ulysses_rank == 0


# Files copied beside exported weights from the directory a model was built from (tokenizer, chat template...).
COPIED_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
NOT_COPIED = {"config.json", "model.safetensors.index.json", "generation_config.json"}


def _copy_source_files(model, directory) -> None:
    """Tokenizer and generation files of the model's source directory (when it was built from one)."""
    import shutil
    from pathlib import Path

    source = getattr(model, "source_dir", None)
    if not source or not Path(source).is_dir():
        return
    for item in sorted(Path(source).iterdir()):
        if (item.is_file() and item.suffix in COPIED_SUFFIXES and item.name not in NOT_COPIED
                and not item.name.endswith(".safetensors.index.json") and not (directory / item.name).exists()):
            shutil.copy2(item, directory / item.name)
    generation = Path(source) / "generation_config.json"
    if generation.is_file() and not (directory / generation.name).exists():
        shutil.copy2(generation, directory / generation.name)


def vllm_file_name(tp_rank: int, part: int, pp_rank: int = 0, pp: int = 1) -> str:
    """vLLM ``ShardedStateLoader``'s default file names."""
    if pp > 1:
        return f"model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
    return f"model-rank-{tp_rank}-part-{part}.safetensors"


def save_vllm_sharded_state(model, directory, *, tp: int, pp: int = 1, dtype: torch.dtype | None = None,
                            max_shard_size: str | int = "5GB", merge_lora: bool = False,
                            bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Collective over every rank: vLLM's ``sharded_state`` directory for an engine with TP ``tp`` and
    PP ``pp`` (``LLM(model=directory, load_format="sharded_state", tensor_parallel_size=tp,
    pipeline_parallel_size=pp)``), plus config.json and the source's tokenizer files.

    The tensors of vLLM TP rank r come from ``iter_export("vllm", target_tp=tp, target_rank=r)``
    (assembled from the overlapping training shards, never a full gather) and are written by global
    rank ``r % world_size``, one file per vLLM pipeline stage and part of at most ``max_shard_size``
    (vLLM's own ``save_sharded_state`` rule), with the four attention scale scalars vLLM's strict
    loader expects. Atomic like ``save_pretrained``.
    """
    from safetensors.torch import save_file

    staged = _StagedDirectory(directory, "save_vllm_sharded_state")

    def check_layout() -> None:
        try:
            vllm_format.check_layout(model.config, tp, pp)
        except vllm_format.VllmLayoutError as exc:
            raise ExportError(str(exc)) from None

    staged.check((_check_saveable, model, merge_lora), (check_layout,))
    limit = _parse_shard_size(max_shard_size)
    cfg = model.config
    dtype = dtype or next(model.parameters()).dtype
    vmap = vllm_format.vllm_weight_map(model.weight_map, cfg)
    stage_keys = [vllm_format.stage_tensors(vmap, cfg, p, pp) for p in range(pp)]
    # exported key (a parameter name) -> [(vLLM stage, key in that stage's files)]
    placement: dict[str, list[tuple[int, str]]] = {}
    for p, tensors in enumerate(stage_keys):
        for t in tensors:
            if t.entry is not None:
                placement.setdefault(t.entry.param, []).append((p, t.key))
    world = dist.get_world_size() if dist.is_initialized() else 1
    staged.open()
    for r in range(tp):
        writer = staged.rank == r % world
        pending: list[dict[str, torch.Tensor]] = [{} for _ in range(pp)]
        sizes, parts = [0] * pp, [0] * pp

        def flush(p: int) -> None:
            if pending[p]:
                staged.run(save_file, pending[p], str(staged.tmp / vllm_file_name(r, parts[p], p, pp)),
                           metadata={"format": "pt"})
                parts[p] += 1
                pending[p], sizes[p] = {}, 0

        def add(p: int, key: str, tensor: torch.Tensor) -> None:
            nbytes = tensor.numel() * tensor.element_size()
            if pending[p] and sizes[p] + nbytes > limit:
                flush(p)
            pending[p][key] = tensor
            sizes[p] += nbytes

        for bucket in iter_export(model, "vllm", bucket_bytes=bucket_bytes, dtype=dtype, merge_lora=merge_lora,
                                  target_tp=tp, target_rank=r):
            if not writer:
                continue
            for name, tensor in bucket.tensors():
                for p, key in placement[name]:
                    add(p, key, tensor.to("cpu").clone())
                    if name.endswith("self_attn.o_proj.weight"):  # the layer's attention scales follow it
                        for scale in vllm_format.ATTENTION_SCALES:
                            add(p, name.replace("o_proj.weight", f"attn.{scale}"), torch.ones((), dtype=torch.float32))
        if writer:
            for p in range(pp):
                flush(p)

    def finish(tmp) -> None:
        _saved_config(model.hf_config, dtype).save_pretrained(str(tmp))
        _copy_source_files(model, tmp)

    staged.commit(finish)


def _raise(message: str) -> None:
    raise ExportError(message)
