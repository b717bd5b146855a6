"""Writing checkpoints from a live parallel model: HF directories and vLLM ``sharded_state``.

Both are collective over every rank and atomic (``_StagedDirectory``: a temporary sibling
directory renamed by global rank 0; any rank's failure is agreed on by all ranks, nothing is left
half-written, no rank is left waiting). The tensors come from the same bucket plans and exports as
live export (``buckets.py``); each file is written once, by one rank. ``save_pretrained`` also writes the
source checkpoint's tensors the model does not hold (``_carried``: a hybrid's MTP block and vision tower).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist

from models.common import vllm_format
from models.common.export import fp8
from models.common.export.buckets import (
    DEFAULT_BUCKET_BYTES,
    ExportError,
    _Failure,
    _first_replica,
    _source_tensors,
    check_vllm_fp8,
    iter_export,
    plan_buckets,
)
from models.common.hf_files import fused_expert_layout
from models.common.weights import export_hf_state, hf_shapes


def _file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


CAUSAL_LM_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


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


def _saved_config(hf_config, dtype: torch.dtype, quantization_config: dict | None = None):
    """A copy of the config recording the stored dtype (``dtype`` on transformers 5, ``torch_dtype``
    before; FP8: the dtype of the unquantized tensors), the model class (vLLM and SGLang read
    ``architectures``) and, for a quantized export, its ``quantization_config``."""
    import copy

    saved = copy.deepcopy(hf_config)
    if quantization_config is not None:
        saved.quantization_config = quantization_config
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

    def check(self, *checks) -> list:
        """Run ``(fn, *args)`` checks on every rank and agree (before anything is written); their results."""
        self.failure.run(_check_destination, self.target)
        results = [self.failure.run(fn, *args) for fn, *args in checks]
        self.raise_if_failed()
        return results

    def open(self) -> None:
        import shutil

        def prepare() -> None:
            for stale in self.target.parent.glob(f".{self.target.name}.pmz-tmp-*"):
                shutil.rmtree(stale)
            self.tmp.mkdir()  # 0777 & ~umask, like every directory the process creates

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


def _check_saveable(model, merge_lora: bool, quantization=None) -> None:
    try:
        fp8.check_quantization(quantization)
    except fp8.QuantizationError as exc:
        raise ExportError(str(exc)) from None
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
                    merge_lora: bool = False, quantization: str | None = None) -> None:
    """Collective over every rank: write an HF checkpoint directory that transformers loads unchanged.

    Files are planned from the config alone (the same on every rank); each file holds tensors of one
    pipeline stage and is written once, by one TP rank of that stage's first replica (files dealt
    round-robin over the TP ranks), from tensors gathered over TP (ranks that do not write drop
    them as they come). Atomic and failure-agreeing (``_StagedDirectory``): no half-written
    ``directory``, no rank left waiting. Needs a filesystem every writing rank sees at the same path.

    Tensors of the source checkpoint the model does not hold (``_carried``: a Gated DeltaNet hybrid's MTP block
    ``mtp.*`` and a conditional-generation checkpoint's vision tower ``model.visual.*``, which the model leaves
    unread as transformers' CausalLM classes do) are written too, bitwise from ``model.source_dir`` (cast to
    ``dtype`` only where it differs from the stored dtype, so the directory holds one dtype), in files of their
    own after the model's (each written by one rank, global rank ``j % world`` for the j-th), listed in the
    index; planned, and refused if the source no longer holds them, before anything is written. Without them
    transformers' conditional-generation class would start a random tower and the MTP block that config.json
    declares would be gone. ``merge_lora`` leaves the carried tensors as stored (a text-only build's tower); a
    vision-language build holds its tower and merges the tower's adapters as the text model's.

    ``quantization="fp8"``: linear weights as block-wise FP8 with ``<name>_scale_inv`` and
    ``quantization_config`` in config.json (``fp8.py``), quantized in fp32 from the parameters;
    ``dtype`` is then the dtype of the other tensors. Files are planned on the parameters' bytes, so
    FP8 files come out smaller than ``max_shard_size``. Carried tensors follow ``fp8.py``'s roles as
    ``pmz convert --to hf --quantize fp8`` does: the MTP block's linears (``fc``, its decoder layer's
    projections) quantized from the source values, its norms and router kept (the router listed in
    ``modules_to_not_convert``); the vision tower is never quantized (``fp8.carried_role``), its linear
    modules listed in ``modules_to_not_convert`` by ``fp8.carried_linear_modules``, the rule pmz reads too.
    """
    import json

    from models.common.hf_files import save_safetensors

    staged = _StagedDirectory(directory, "save_pretrained")
    _, carried, _ = staged.check((_check_saveable, model, merge_lora, quantization), (_carried, model, quantization),
                                 (_fused_fp8_starts, model, quantization))
    source, carried_layout, fp8_carried, mtp_layers = carried or (None, (), frozenset(), 0)
    limit = _parse_shard_size(max_shard_size)
    hf_config = model.hf_config
    groups = model.groups
    source_dtype = next(model.parameters()).dtype
    dtype = dtype or source_dtype
    element_size = torch.empty((), dtype=source_dtype if quantization else dtype).element_size()
    plans = plan_buckets(model, limit, element_size)
    carried_files = _plan_carried(carried_layout, dtype, limit)
    names = _file_names(len(plans) + len(carried_files))
    staged.open()
    shapes = hf_shapes(model.config, model.weight_map)
    named = _source_tensors(model, merge_lora)
    for index, (plan, file_name) in enumerate(zip(plans, names)):
        if groups.pp_rank != plan.stage:
            continue
        writer = _first_replica(groups) and groups.tp_rank == index % groups.tp_size
        tensors = {}
        quantized = {n for e in plan.entries if quantization and fp8.is_quantized(e) for n in e.hf}
        fused = _FusedExperts(plan, model.weight_map, dtype, tensors, quantized) if writer else None
        for name, full in export_hf_state(named, list(plan.entries), shapes, groups.tp_group, groups.ep_group):
            if writer and not fused.place(name, full):
                for key, t in fp8.quantize_named([(name, full)], name in quantized, dtype):
                    tensors[key] = t.to(device="cpu").contiguous()
        if writer:
            staged.run(save_safetensors, tensors, staged.tmp / file_name, metadata={"format": "pt"})
        del tensors
    world = dist.get_world_size() if dist.is_initialized() else 1
    for j, (layout, file_name) in enumerate(zip(carried_files, names[len(plans):])):
        if staged.rank == j % world:
            staged.run(_write_carried, source, layout, dtype, fp8_carried, staged.tmp / file_name)

    def stored(plan):  # (name, shape, dtype) of what the plan's file holds
        quantized = {n for e in plan.entries if quantization and fp8.is_quantized(e) for n in e.hf}
        layout, within = [(m.name, m.shape) for m in plan.metas], {}
        if model.weight_map.fused_experts:  # experts fused: FP8 when their experts are
            layout, within = fused_expert_layout(layout)
        quantized |= {within[n][0] for n in within if n in quantized}
        return [t for n, shape in layout for t in fp8.stored_layout(n, shape, n in quantized, dtype)]

    def finish(tmp) -> None:
        _copy_source_files(model, tmp)
        qconfig = None
        if quantization:
            roles = replace(model.weight_map, mtp_layers=mtp_layers) if mtp_layers else model.weight_map
            tower = getattr(model.config, "carried", ()) if carried_layout else ()  # as pmz reads it: config order
            qconfig = fp8.quantization_config(roles, model.config.num_hidden_layers, tower)
        _saved_config(hf_config, dtype, qconfig).save_pretrained(str(tmp))
        files = [(stored(plan), file_name) for plan, file_name in zip(plans, names)]
        files += [([t for n, shape in layout for t in fp8.stored_layout(n, shape, n in fp8_carried, dtype)], file_name)
                  for layout, file_name in zip(carried_files, names[len(plans):])]
        if len(files) > 1:
            size = sum(math.prod(shape) * dt.itemsize for layout, _ in files for _, shape, dt in layout)
            index = {"metadata": {"total_size": size},
                     "weight_map": {name: file_name for layout, file_name in files for name, _, _ in layout}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    staged.commit(finish)


class _FusedExperts:
    """A writing rank's fused expert tensors of one file (a ``fused_experts`` weight map, Qwen3-VL-MoE: each
    layer's experts stored as ``mlp.experts.gate_up_proj [E, 2F, H]`` / ``down_proj [E, H, F]``, the layout
    ``hf_files.fused_expert_layout`` gives and ``per_expert_views`` reads): each fused tensor is allocated in
    ``tensors`` (the file's dict, so it keeps the header's order) when its first expert arrives and every
    per-expert tensor is copied into its range as the export yields it, so a layer's experts are held once.
    A map without fused experts places nothing."""

    def __init__(self, plan, wmap, dtype: torch.dtype, tensors: dict, quantized: set[str] = frozenset()) -> None:
        self.within: dict[str, tuple[str, int]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        if wmap.fused_experts:
            layout, self.within = fused_expert_layout([(m.name, m.shape) for m in plan.metas])
            self.shapes = dict(layout)
        self.dtype, self.tensors, self.quantized = dtype, tensors, quantized

    def place(self, name: str, full: torch.Tensor) -> bool:
        """Copy ``full`` into its fused tensor (FP8 ones: its FP8 rows and their block rows of the fused scales,
        ``fp8.scale_offset``); False when ``name`` is not a fused expert tensor."""
        if name not in self.within:
            return False
        fused, at = self.within[name]
        parts = [(fused, at, full)]
        if name in self.quantized:
            q, s = fp8.quantize(full)
            parts = [(fused, at, q), (fp8.scale_name(fused), fp8.scale_offset(self.shapes[fused], at), s)]
        for key, offset, tensor in parts:
            if key not in self.tensors:
                shape = fp8.scale_shape(self.shapes[fused]) if key != fused else self.shapes[fused]
                kind = torch.float32 if key != fused else tensor.dtype if name in self.quantized else self.dtype
                self.tensors[key] = torch.empty(shape, dtype=kind)
            self.tensors[key].view(-1)[offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
        return True


def _fused_fp8_starts(model, quantization) -> None:
    """ExportError (before anything is written) when an FP8 ``save_pretrained`` of experts stored fused cannot
    place an expert's FP8 rows on block edges of its fused tensor (``fp8.fused_expert_starts``)."""
    wmap = model.weight_map
    if not quantization or not wmap.fused_experts:
        return
    quantized = {n for e in wmap.entries(range(model.config.num_hidden_layers)) if fp8.is_quantized(e) for n in e.hf}
    try:
        fp8.fused_expert_starts(list(hf_shapes(model.config, wmap).items()), quantized)
    except fp8.QuantizationError as exc:
        raise ExportError(f"quantization={quantization!r}: {exc}") from None


Layout = tuple[tuple[str, tuple[int, ...]], ...]


def _carried(model, quantization: str | None = None):
    """``(source, ((name, shape), ...), FP8 names, MTP layers)``: the tensors of the model's source checkpoint
    that the model does not hold, sorted by name, read through the loader's reader (``weights.checkpoint_source``:
    the validated files, fused experts as per-expert views, as the model's own experts are written); None when
    there are none.

    Only a Gated DeltaNet hybrid leaves checkpoint tensors unread (``builder._unloaded_tensors``: the MTP block,
    a conditional-generation checkpoint's vision tower); a model built from a transformers config or a tensor
    source has no ``source_dir`` and nothing to carry. What is carried is what the directory holds beyond the
    model's weight map as the builder recorded it (``model.unloaded_tensors``: exactly those names; a tied
    checkpoint's ``lm_head.weight`` and ``IGNORED_SUFFIXES`` are not among them). ExportError naming the
    directory and a tensor when it no longer reads as the checkpoint
    the model was built from: gone or unreadable, a tensor the model holds missing or of another shape there, or
    a tower tensor the config declares (``cfg.carried``) or an MTP tensor (shape from the MTP block's weight-map
    entries) missing or of another shape; carrying would then write another checkpoint's tensors, or none.
    FP8 names (``quantization``): the MTP tensors ``fp8.is_quantized`` stores as FP8 (the roles
    ``pmz convert --quantize fp8`` reads, ``converters/torch_path/hf_fp8.role_map``)."""
    from models.common.errors import CheckpointError
    from models.common.hybrid.weights import MTP_PREFIX, HybridWeightMap
    from models.common.weights import checkpoint_source

    directory, wmap, cfg = getattr(model, "source_dir", None), model.weight_map, model.config
    if directory is None or not isinstance(wmap, HybridWeightMap) or not getattr(model, "unloaded_tensors", ()):
        return None  # nothing was left unread at build time (builder records it): nothing to carry
    what = f"{directory} (the model's source directory, whose tensors the model does not hold are carried)"
    try:
        source = checkpoint_source(directory, cfg, where=what)
    except (CheckpointError, OSError) as exc:
        example = f" such as {cfg.carried[0][0]}" if cfg.carried else ""
        raise ExportError(f"{what}: no longer readable, its tensors{example} cannot be carried: {exc}") from None
    held = hf_shapes(cfg, wmap)
    names = source.names()
    # exactly what the builder left unread (its one rule, ``builder._unloaded_tensors``), not re-derived from the
    # directory: a tensor added there since the build is not written into the model's checkpoint
    extra = sorted(model.unloaded_tensors)
    for name in extra:
        if name not in names:
            raise ExportError(f"{what}: does not hold {name}, which the model left unread when it was built "
                              f"(moved or changed since?)")
    mtp = {int(n.split(".")[2]) for n in extra if n.startswith(MTP_PREFIX + "layers.") and n.count(".") > 2
           and n.split(".")[2].isdigit()}
    expected = {**hf_shapes(cfg, wmap.for_conversion(max(mtp) + 1 if mtp else 0)), **dict(cfg.carried)}
    for name in [*held, *dict(cfg.carried)]:
        if name not in names:
            raise ExportError(f"{what}: does not hold {name} (moved or changed since the model was built?)")
    for name in sorted(names & set(expected)):
        if tuple(source.shape(name)) != tuple(expected[name]):
            raise ExportError(f"{what}: {name} has shape {tuple(source.shape(name))} there, the model's config "
                              f"gives {tuple(expected[name])} (changed since the model was built)")
    if not extra:
        return None
    layers = max(mtp) + 1 if mtp else 0
    quantized = frozenset()
    if quantization and layers:
        try:
            quantized = frozenset(n for e in replace(wmap, mtp_layers=layers).mtp_entries() if fp8.is_quantized(e)
                                  for n in e.hf if n in names)
        except fp8.QuantizationError as exc:
            raise ExportError(str(exc)) from None
    return source, tuple((n, tuple(source.shape(n))) for n in extra), quantized, layers


def _plan_carried(layout: Layout, dtype: torch.dtype, limit: int) -> list[Layout]:
    """The carried tensors in files of at most ``limit`` bytes in ``dtype`` (one tensor alone may be larger)."""
    files: list[Layout] = []
    current: list[tuple[str, tuple[int, ...]]] = []
    size = 0
    for name, shape in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        if current and size + nbytes > limit:
            files.append(tuple(current))
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    return files + ([tuple(current)] if current else [])


_CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _write_carried(source, layout: Layout, dtype: torch.dtype, quantized: frozenset, path) -> None:
    """One file of carried tensors, each read whole in its stored dtype and cast only where ``dtype`` differs
    (``quantized``: stored as FP8 with its scales instead, ``fp8.quantize_named``)."""
    from models.common.hf_files import save_safetensors
    from parallel.sharding import Piece

    tensors = {}
    for name, _ in layout:
        t = source.read(name, Piece(None))
        if name in quantized:
            tensors.update((k, v.contiguous()) for k, v in fp8.quantize_named([(name, t)], True, dtype))
            continue
        if t.dtype != dtype:
            if t.dtype not in _CASTABLE:
                raise ExportError(f"{name}: stored as {t.dtype} in the source, which is not cast to {dtype} "
                                  f"(only float16/bfloat16/float32/float64 tensors are)")
            t = t.to(dtype)
        tensors[name] = t.contiguous()
    save_safetensors(tensors, path, metadata={"format": "pt"})


def _copy_source_files(model, directory) -> None:
    """Tokenizer and generation files of the model's source directory (when it was built from one)."""
    from pathlib import Path

    from models.common.sources import copy_companion_files

    source = getattr(model, "source_dir", None)
    if source and Path(source).is_dir():
        copy_companion_files(source, directory)


def save_vllm_sharded_state(model, directory, *, tp: int, pp: int = 1, dtype: torch.dtype | None = None,
                            max_shard_size: str | int = "5GB", merge_lora: bool = False,
                            bucket_bytes: int = DEFAULT_BUCKET_BYTES, quantization: str | None = None) -> None:
    """Collective over every rank: vLLM's ``sharded_state`` directory for an engine with TP ``tp`` and
    PP ``pp`` (``LLM(model=directory, load_format="sharded_state", tensor_parallel_size=tp,
    pipeline_parallel_size=pp)``), plus config.json and the source's tokenizer files.

    The tensors of vLLM TP rank r come from ``iter_export("vllm", target_tp=tp, target_rank=r)``
    (assembled from the overlapping training shards, never a full gather) and are written by global
    rank ``r % world_size``, one file per vLLM pipeline stage and part of at most ``max_shard_size``
    (vLLM's own ``save_sharded_state`` rule), with the four attention scale scalars vLLM's strict
    loader expects. Atomic like ``save_pretrained``.

    ``quantization="fp8"``: each rank's linear shards as FP8 with their ``_scale_inv`` blocks
    (``fp8.py``), ``quantization_config`` in config.json, and the four KV-cache scale parameters
    vLLM's FP8 attention registers (``fp8.vllm_attention_scales``); a ``tp`` whose shard boundaries cut a
    128 block is refused before anything is written, naming the numbers.
    """
    from models.common.hf_files import save_safetensors

    staged = _StagedDirectory(directory, "save_vllm_sharded_state")

    def check_layout() -> None:
        try:
            vllm_format.check_layout(model.config, tp, pp)
            vllm_format.check_sharded_state_source(model.weight_map, model.config)
        except vllm_format.VllmLayoutError as exc:
            raise ExportError(str(exc)) from None

    checks = [(_check_saveable, model, merge_lora, quantization), (check_layout,)]
    staged.check(*checks, *([(check_vllm_fp8, model, tp)] if quantization else []))
    limit = _parse_shard_size(max_shard_size)
    cfg = model.config
    dtype = dtype or next(model.parameters()).dtype
    vmap = vllm_format.vllm_weight_map(model.weight_map, cfg)
    stage_keys = [vllm_format.stage_tensors(vmap, cfg, p, pp) for p in range(pp)]
    # exported key (vLLM's parameter name) -> [(vLLM stage, key in that stage's files)]
    placement: dict[str, list[tuple[int, str]]] = {}
    for p, tensors in enumerate(stage_keys):
        for t in tensors:
            if t.entry is not None:
                placement.setdefault(vllm_format.parameter_key(t.entry, cfg), []).append((p, t.key))
    world = dist.get_world_size() if dist.is_initialized() else 1
    staged.open()
    for r in range(tp):
        writer = staged.rank == r % world

        def writer_for(p: int, r: int = r):
            def write(tensors: dict, part: int) -> None:
                staged.run(save_safetensors, tensors, staged.tmp / vllm_format.vllm_file_name(r, part, p, pp),
                           metadata={"format": "pt"})
            return write

        parts = [vllm_format.PartSplitter(limit, writer_for(p)) for p in range(pp)]
        for bucket in iter_export(model, "vllm", bucket_bytes=bucket_bytes, dtype=dtype, merge_lora=merge_lora,
                                  target_tp=tp, target_rank=r, quantization=quantization):
            if not writer:
                continue
            for name, tensor in bucket.tensors():
                is_scale = name.endswith(fp8.SCALE_SUFFIX) and name.removesuffix(fp8.SCALE_SUFFIX) in placement
                base = name.removesuffix(fp8.SCALE_SUFFIX) if is_scale else name
                for p, key in placement[base]:
                    parts[p].add(fp8.scale_name(key) if is_scale else key, tensor.to("cpu").clone())
                    if name.endswith("self_attn.o_proj.weight"):  # the layer's attention scales follow it
                        scales = [(s, 1.0) for s in vllm_format.ATTENTION_SCALES]
                        for scale, value in scales + fp8.vllm_attention_scales(quantization):
                            parts[p].add(name.replace("o_proj.weight", f"attn.{scale}"),
                                         torch.full((), value, dtype=torch.float32))
        if writer:
            for splitter in parts:
                splitter.close()

    def finish(tmp) -> None:
        _copy_source_files(model, tmp)
        qconfig = fp8.quantization_config(model.weight_map, cfg.num_hidden_layers) if quantization else None
        _saved_config(model.hf_config, dtype, qconfig).save_pretrained(str(tmp))

    staged.commit(finish)
