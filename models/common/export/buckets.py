"""Live export of a running parallel model as flat buckets (any tp/pp/vpp/dp/cp/ulysses/fsdp).

``iter_export(model, format="hf"|"vllm", bucket_bytes=..., dtype=None, transport=...)`` is a
collective iterator: every rank of the job calls it and receives the same sequence of
``ExportBucket``s, each one contiguous buffer of one dtype plus the names, shapes and offsets of the
tensors in it (``.tensors()`` gives ``(name, view)`` pairs). ``"hf"``: full tensors under HF names
(tied embeddings once, as HF stores them); ``"vllm"``: the shards of one vLLM rank
(``target_tp``/``target_rank``) under vLLM's names (``vllm_format.py``).

The bucket plan is pure arithmetic on the config and the layout (the same on every rank); a bucket
holds whole parameters of one pipeline stage. Filling it:
  * collective transport, HF: the owning stage gathers each parameter over TP and merges it with
    the weight map's rules (``export_hf_state``: the entries and rules loading and the converters
    use); vLLM: each training TP rank broadcasts, once per bucket, only the rows the target rank
    holds (``_plan_moves``: derived from the same rules, no full gather). The buffer is then
    broadcast over PP. Every data-parallel replica does this on its own (no DP traffic, except
    FSDP2's un-sharding of each parameter). Memory beyond the model: the bucket plus one parameter
    in flight.
  * shared-memory transport (one host, CPU): the same move plan, but each rank of the owning
    stage's first replica writes its own rows straight into a bucket in ``/dev/shm`` that every
    rank reads in place after a barrier (two rotating segments kept on the model).
Checkpoint writers built on this live in ``saving.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator

import torch
import torch.distributed as dist

from models.common import vllm_format
from models.common.blocks.lora import MergedParameters
from models.common.export import fp8
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
    """Where one HF tensor sits in a bucket's buffer: elements ``[offset, offset + numel)``; with
    ``dtype`` (a quantized bucket: one byte buffer of mixed dtypes) bytes ``[offset, offset + nbytes)``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    dtype: torch.dtype | None = None  # None: the buffer's own dtype

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
        return [(m.name, self.buffer[m.offset:m.offset + m.numel].view(m.shape) if m.dtype is None else
                 self.buffer[m.offset:m.offset + m.numel * m.dtype.itemsize].view(m.dtype).view(m.shape))
                for m in self.metas]


def _packed_bucket(pairs: list[tuple[str, torch.Tensor]], device) -> ExportBucket:
    """One byte buffer holding tensors of several dtypes, each at a 16-byte aligned offset."""
    metas, offset = [], 0
    for name, tensor in pairs:
        metas.append(TensorMeta(name, tuple(tensor.shape), offset, tensor.dtype))
        offset += -(-tensor.numel() * tensor.element_size() // 16) * 16
    buffer = torch.empty(offset, dtype=torch.uint8, device=device)
    for meta, (_, tensor) in zip(metas, pairs):
        flat = tensor.reshape(-1).view(torch.uint8)
        buffer[meta.offset:meta.offset + flat.numel()].copy_(flat)
    return ExportBucket(buffer, tuple(metas))


def _quantized(bucket: ExportBucket, plan: BucketPlan, format: str, dtype: torch.dtype) -> ExportBucket:
    """``bucket`` (source dtype) as stored with FP8 (``fp8.py``): each linear weight as e4m3 plus its
    ``_scale_inv``, every other tensor cast to ``dtype``; the same on every rank (same input)."""
    views = dict(bucket.tensors())
    groups = zip(plan.entries, ([m.name] for m in plan.metas)) if format == "vllm" else \
        ((e, list(e.hf)) for e in plan.entries)
    stored = [pair for entry, names in groups
              for pair in fp8.quantize_named([(n, views[n]) for n in names], fp8.is_quantized(entry), dtype)]
    return _packed_bucket(stored, bucket.buffer.device)


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
    Callers validate ``bucket_bytes`` (``iter_export``) or the shard size (``save_pretrained``) first.
    """
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
    """Internal name -> tensor to export: the parameters, or with ``merge_lora`` the LoRA-merged weights
    (callers have checked that the model has an adapter, before any collective)."""
    if merge_lora:
        return MergedParameters(model)
    return _Unsharded(model.named_parameters())


def _check_export_args(model, format, target_tp, target_rank, bucket_bytes, quantization=None) -> None:
    try:
        fp8.check_quantization(quantization)
    except fp8.QuantizationError as exc:
        raise ExportError(str(exc)) from None
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
    if quantization is not None:
        check_vllm_fp8(model, target_tp)


def check_vllm_fp8(model, tp: int) -> None:
    """ExportError naming the numbers when vLLM at TP ``tp`` cannot take this model's FP8 shards."""
    vmap = vllm_format.vllm_weight_map(model.weight_map, model.config)
    try:
        fp8.vllm_block_check(vmap, model.config, hf_shapes(model.config, vmap), tp)
    except fp8.QuantizationError as exc:
        raise ExportError(str(exc)) from None


@torch.no_grad()
def iter_export(model, format: str = "hf", *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                dtype: torch.dtype | None = None, merge_lora: bool = False, target_tp: int | None = None,
                target_rank: int | None = None, transport: str = "collective",
                quantization: str | None = None) -> Iterator[ExportBucket]:
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

    ``quantization="fp8"``: linear weights as block-wise FP8 e4m3 plus ``<name>_scale_inv`` (fp32,
    one per 128x128 block), everything else in ``dtype`` (rule and format: ``fp8.py``). Each bucket
    is gathered in the parameters' dtype (``bucket_bytes`` bounds that), quantized in fp32 by every
    rank alike, and yielded as one byte buffer whose metas carry each tensor's dtype (valid as long
    as it is kept, whatever the transport). ``format="vllm"`` refuses a ``target_tp`` whose shard
    boundaries cut a 128 block, naming the numbers.
    """
    failure = _Failure()
    failure.run(_check_export_args, model, format, target_tp, target_rank, bucket_bytes, quantization)
    if merge_lora and getattr(model, "lora_config", None) is None:
        failure.run(_raise, "merge_lora=True but the model has no LoRA adapter")
    if transport not in TRANSPORTS:
        failure.run(_raise, f"unknown transport {transport!r} (choose {', '.join(TRANSPORTS)})")
    if model.weight_map.has_experts and transport == "shm":
        # expert stacks are gathered over EP (one layer at a time); the shared-memory writers do not know them yet
        failure.run(_raise, "transport='shm' is not supported for mixture-of-experts models yet "
                            "(use transport='collective')")
    problem = failure.agree(same=(format, target_tp, target_rank, bucket_bytes, str(dtype), merge_lora, transport,
                                  quantization))
    if problem:
        raise ExportError(f"iter_export: {problem}")
    if transport == "shm":
        from parallel.shared_memory import single_host

        if not single_host():
            raise ExportError("iter_export: transport='shm' needs every rank on one host with /dev/shm")
    groups = model.groups
    params = list(model.parameters())
    dtype = dtype or params[0].dtype
    kept_dtype, dtype = dtype, (params[0].dtype if quantization else dtype)  # FP8 is taken from the source
    device = params[0].device if params[0].device.type != "meta" else None
    element_size = torch.empty((), dtype=dtype).element_size()
    plans = plan_buckets(model, bucket_bytes, element_size, format, target_tp or 1)
    shapes = hf_shapes(model.config, model.weight_map)
    named = _source_tensors(model, merge_lora)
    src_entries = {e.param: e for e in model.weight_entries()}
    shared = _open_shared(model, plans, element_size, device) if transport == "shm" else None
    for index, plan in enumerate(plans):
        if shared is not None:
            buffer = shared.segment(index % 2, dtype, plan.numel)
            if groups.pp_rank == plan.stage:
                _fill_shared(_plan_moves(buffer, plan, named, model, format, target_tp, target_rank, shapes,
                                         src_entries), groups)
            if dist.is_initialized():
                dist.barrier()  # the bucket is complete for every reader
            bucket = ExportBucket(buffer, plan.metas)
            yield _quantized(bucket, plan, format, kept_dtype) if quantization else bucket
            continue
        buffer = torch.empty(plan.numel, dtype=dtype, device=device)
        if groups.pp_rank == plan.stage:
            if format == "vllm":
                dense = replace(plan, entries=tuple(e for e in plan.entries if not e.experts),
                                metas=tuple(m for e, m in zip(plan.entries, plan.metas) if not e.experts))
                moves = _plan_moves(buffer, dense, named, model, format, target_tp, target_rank, shapes, src_entries)
                _fill_by_broadcast(buffer, moves, groups)
                for entry, meta in zip(plan.entries, plan.metas):
                    if entry.experts:
                        _fill_vllm_experts(buffer, entry, meta, named, src_entries[entry.param], shapes, groups,
                                           target_tp, target_rank)
            else:
                positions = {m.name: m for m in plan.metas}
                for name, full in export_hf_state(named, list(plan.entries), shapes, groups.tp_group, groups.ep_group):
                    meta = positions[name]
                    buffer[meta.offset:meta.offset + meta.numel].copy_(full.reshape(-1))
        if groups.pp_size > 1:
            dist.broadcast(buffer, src=dist.get_global_rank(groups.pp_group, plan.stage), group=groups.pp_group)
        bucket = ExportBucket(buffer, plan.metas)
        yield _quantized(bucket, plan, format, kept_dtype) if quantization else bucket


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
                target_rank: int, shapes: dict, src_entries: dict[str, WeightEntry]) -> list[_Move]:
    """Which rows of which training TP rank's shards land where in the bucket, from the rules alone.

    HF buckets hold full tensors (the target is "TP 1": one region per HF tensor); vLLM buckets
    hold rank ``target_rank``'s packed shards at ``target_tp``. A row held by several ranks
    (replicated KV heads) comes from the lowest; replicated tensors from every rank's own copy.
    ``shapes``: full HF shapes; ``src_entries``: this stage's weight-map entries by parameter name.
    """
    groups = model.groups
    tp, me = groups.tp_size, groups.tp_rank
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


def _fill_vllm_experts(buffer: torch.Tensor, entry: WeightEntry, meta: TensorMeta, named: dict,
                       src_entry: WeightEntry, shapes: dict, groups, target_tp: int, target_rank: int) -> None:
    """One layer's expert stack for vLLM rank ``target_rank`` of ``target_tp``: the full experts
    (``export_hf_state``: gathered over EP, one layer at a time) cut with vLLM's rules (``entry``)."""
    full = dict(export_hf_state(named, [src_entry], shapes, groups.tp_group, groups.ep_group))
    buffer[meta.offset:meta.offset + meta.numel].view(meta.shape).copy_(
        vllm_format.pack_shard(entry, full, target_rank, target_tp))


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


def _first_replica(groups) -> bool:
    return groups.dp_rank == 0 and groups.cp_rank == 0 and groups.ulysses_rank == 0


def _raise(message: str) -> None:
    raise ExportError(message)
