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

from models.common.weights import WeightEntry, export_hf_state, hf_shapes
from parallel.fsdp import unshard
from parallel.pipeline_layout import stage_layer_ranges

FORMATS = ("hf",)
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


def plan_buckets(model, bucket_bytes: int, element_size: int) -> list[BucketPlan]:
    """Buckets in export order (stage by stage, in the weight map's order within a stage).

    A bucket holds whole parameters (all HF tensors packed into one parameter travel together) of
    one stage, at most ``bucket_bytes`` - except a single parameter larger than that, which gets a
    bucket of its own.
    """
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ExportError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    cfg, groups = model.config, model.groups
    shapes = hf_shapes(cfg, model.weight_map)
    ranges = stage_layer_ranges(cfg.num_hidden_layers, groups.config)
    plans: list[BucketPlan] = []
    for stage, chunks in enumerate(ranges):
        layers = sorted(i for r in chunks for i in r)
        entries = model.weight_map.entries(layers, first=stage == 0, last=stage == groups.pp_size - 1)
        current: list[WeightEntry] = []
        metas: list[TensorMeta] = []
        offset = 0

        def close() -> None:
            nonlocal current, metas, offset
            if current:
                plans.append(BucketPlan(stage, tuple(current), tuple(metas), offset))
            current, metas, offset = [], [], 0

        for entry in entries:
            numel = sum(math.prod(shapes[name]) for name in entry.hf)
            if current and (offset + numel) * element_size > bucket_bytes:
                close()
            for name in entry.hf:
                metas.append(TensorMeta(name, tuple(shapes[name]), offset))
                offset += metas[-1].numel
            current.append(entry)
        close()
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


@torch.no_grad()
def iter_export(model, format: str = "hf", *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                dtype: torch.dtype | None = None, merge_lora: bool = False) -> Iterator[ExportBucket]:
    """Collective over every rank: yields the same ``ExportBucket``s everywhere (see module doc).

    ``dtype``: the exported dtype (default: the parameters'); ``merge_lora``: weights with the LoRA
    adapter merged in (the adapter alone: ``lora_state``). Every rank must iterate to the end.
    """
    if format not in FORMATS:
        raise ExportError(f"unknown export format {format!r} (choose {', '.join(FORMATS)})")
    groups = model.groups
    params = list(model.parameters())
    dtype = dtype or params[0].dtype
    device = params[0].device if params[0].device.type != "meta" else None
    element_size = torch.empty((), dtype=dtype).element_size()
    plans = plan_buckets(model, bucket_bytes, element_size)
    shapes = hf_shapes(model.config, model.weight_map)
    named = _source_tensors(model, merge_lora)
    for plan in plans:
        buffer = torch.empty(plan.numel, dtype=dtype, device=device)
        if groups.pp_rank == plan.stage:
            positions = {m.name: m for m in plan.metas}
            for name, full in export_hf_state(named, list(plan.entries), shapes, groups.tp_group):
                meta = positions[name]
                buffer[meta.offset:meta.offset + meta.numel].copy_(full.reshape(-1))
        if groups.pp_size > 1:
            dist.broadcast(buffer, src=dist.get_global_rank(groups.pp_group, plan.stage), group=groups.pp_group)
        yield ExportBucket(buffer, plan.metas)


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

    def agree(self) -> str | None:
        """Collective: the first failing rank's message on every rank (None when all succeeded)."""
        if not dist.is_initialized():
            return self.message
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, self.message)
        failed = [(r, m) for r, m in enumerate(flags) if m is not None]
        return f"rank {failed[0][0]}: {failed[0][1]}" if failed else None


def _check_destination(target) -> None:
    import os

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


def save_pretrained(model, directory, *, dtype: torch.dtype | None = None, max_shard_size: str | int = "5GB",
                    merge_lora: bool = False) -> None:
    """Collective over every rank: write an HF checkpoint directory that transformers loads unchanged.

    Files are planned from the config alone (the same on every rank); each file holds tensors of one
    pipeline stage and is written once, by one TP rank of that stage's first replica (files dealt
    round-robin over the TP ranks), from tensors gathered over TP (ranks that do not write drop
    them as they come). Everything goes to a temporary sibling directory
    (``.<name>.pmz-tmp-<id>``) that global rank 0 renames to ``directory`` at the end. Any rank's
    failure (bad destination, full disk, ...) is agreed on by all ranks at the next step, the
    temporary directory is removed, and every rank raises ``ExportError`` naming the failing rank:
    no half-written ``directory``, no rank left waiting. Stale temporary directories of earlier
    killed runs are removed first. Needs a filesystem every writing rank sees at the same path.
    """
    import json
    import os
    import shutil
    import uuid
    from pathlib import Path

    from safetensors.torch import save_file

    from models.common.sizes import parse_size

    target = Path(directory)
    failure = _Failure()
    failure.run(_check_destination, target)
    hf_config = getattr(model, "hf_config", None)
    if hf_config is None:
        failure.run(_raise, "the model has no transformers config to save (build it with build_parallel_model)")
    limit = failure.run(parse_size, max_shard_size)
    if limit is not None and limit < 1:
        failure.run(_raise, f"max_shard_size={max_shard_size!r} must be positive")
    if merge_lora and getattr(model, "lora_config", None) is None:
        failure.run(_raise, "merge_lora=True but the model has no LoRA adapter")
    problem = failure.agree()
    if problem:
        raise ExportError(f"save_pretrained({target}): {problem}")

    groups = model.groups
    dtype = dtype or next(model.parameters()).dtype
    element_size = torch.empty((), dtype=dtype).element_size()
    plans = plan_buckets(model, limit, element_size)
    names = _file_names(len(plans))
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp_name = [f".{target.name}.pmz-tmp-{uuid.uuid4().hex[:12]}"]
    if dist.is_initialized():
        dist.broadcast_object_list(tmp_name, src=0)
    tmp = target.parent / tmp_name[0]

    def prepare() -> None:
        for stale in target.parent.glob(f".{target.name}.pmz-tmp-*"):
            shutil.rmtree(stale)
        tmp.mkdir()
        tmp.chmod(0o755)

    if rank == 0:
        failure.run(prepare)
    problem = failure.agree()
    if problem:
        raise ExportError(f"save_pretrained({target}): {problem}")
    first_replica = groups.dp_rank == 0 and groups.cp_rank == 0 and groups.ulysses_rank == 0
    shapes = hf_shapes(model.config, model.weight_map)
    named = _source_tensors(model, merge_lora)
    for index, (plan, file_name) in enumerate(zip(plans, names)):
        if groups.pp_rank != plan.stage:
            continue
        writer = first_replica and groups.tp_rank == index % groups.tp_size
        tensors = {}
        for name, full in export_hf_state(named, list(plan.entries), shapes, groups.tp_group):
            if writer:
                tensors[name] = full.to(device="cpu", dtype=dtype).contiguous()
        if writer:
            failure.run(save_file, tensors, str(tmp / file_name), metadata={"format": "pt"})
        del tensors

    def finish() -> None:
        _saved_config(hf_config, dtype).save_pretrained(str(tmp))
        if len(plans) > 1:
            index = {"metadata": {"total_size": sum(p.numel for p in plans) * element_size},
                     "weight_map": {m.name: file_name for plan, file_name in zip(plans, names) for m in plan.metas}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if target.exists():
            raise ExportError(f"{target}: appeared while saving (left untouched)")
        os.rename(tmp, target)

    problem = failure.agree()  # every file written?
    if rank == 0 and problem is None:
        failure.run(finish)
    problem = failure.agree()
    if problem:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"save_pretrained({target}): {problem}")


def _raise(message: str) -> None:
    raise ExportError(message)
