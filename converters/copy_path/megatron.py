"""The copy path's Megatron writers: legacy ``torch`` rank files and ``torch_dist`` checkpoints
written as byte ranges of the source, without torch.

A source (``copy_path.sources.RawSource``: HF safetensors, legacy rank files, torch_dist chunks)
plans every HF tensor as operations on its files (``Copy`` / ``Interleave``); ``megatron_ops`` cuts
them into each output tensor's operations. The containers come from the format modules
(``converters/formats/torch_zip``: the ``torch.save`` zip; ``pickles``: pickles naming torch
classes; ``megatron_dist.dist_metadata``: ``.metadata``); they are laid out first (headers written,
files sized), then tasks fill the tensor bytes (``copy_path.io.fill_file``: ``preadv`` into a
buffer, ``pwrite`` in blocks) in parallel. Output matches the torch path
(``converters/torch_path/megatron``) tensor for tensor, and loads in megatron-core.

Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, the MoE hybrids): legacy rank files per (tp, pp, ep) with
each EP rank's local experts and a copy of the stage's other tensors (column bands read once for all TP and
EP ranks), GroupedMLP ``weight1``/``weight2`` as each expert's shard transposed (``megatron_moe``);
torch_dist experts stacked ``[L, E, ...]`` or per layer as the torch path places them (``megatron_moe``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from converters.copy_path.bands import band_scatterable, band_tasks
from converters.copy_path.io import DEFAULT_BUFFER, fill_file, preallocate, thread_buffer
from converters.copy_path.megatron_moe import dist_placement, grouped_weight
from converters.copy_path.megatron_ops import full_rows_ops, full_segments, row_nbytes, shard_ops
from converters.copy_path.ops import Interleave, Op
from converters.copy_path.raw_source import RawSource
from converters.formats import pickles as pw
from converters.formats.hf_config import write_config_dir
from converters.formats.megatron_args import (
    HF_CONFIG_DIR,
    iteration_folder,
    legacy_rank_dir_name,
    target_arg_fields,
)
from converters.formats.megatron_dist import dist_metadata
from converters.formats.megatron_legacy import rank_file_object
from converters.formats.megatron_moe import check_ep_target
from converters.formats.tensors import TAG_TO_TORCH_NAME
from converters.formats.torch_zip import archive_bytes, layout_archive
from converters.layout.experts import GROUPED_GEMM, SEQUENTIAL, TE_GROUPED, fc_of, stored_key
from converters.layout.hybrid import (
    check_tower_tp,
    dist_components,
    dist_expert,
    dist_extra_states,
    dist_tower_extra_states,
    legacy_extra_states,
    tower_block,
    tower_depth,
    tower_modules,
    unit_keys,
)
from converters.layout.megatron import COL1, LayoutError, megatron_full_shape, megatron_padded_vocab, tp_split_kind
from converters.layout.model import EMBED, FINAL, is_hybrid, require_megatron_layout
from converters.layout.stages import (
    DIST_DATA_FILES,
    DIST_METADATA_JSON,
    RANK_FILE,
    MegatronLayout,
    check_target_stages,
    extra_state_modules,
    final_norm_extra_states,
    layer_extra_states,
    layer_prefix,
    stacks_layers,
    te_norm_extra_states,
    unit_megatron_keys,
    validate_target_layout,
    writes_te_norms,
)
from converters.runtime.tasks import run_tasks
from models.common.errors import CheckpointError
from models.common.weight_map import WeightEntry, hf_shapes

# -------------------------------------------------------------------------------------- targets


@dataclass
class CopyTarget:
    fmt: str  # "megatron" (legacy torch) or "megatron-dist"
    tp: int
    pp: int
    vpp: int
    padded_vocab: int
    tag: str
    layout: MegatronLayout
    args: dict
    iteration: int | None
    hf_shapes: dict = field(default_factory=dict)
    ep: int = 1  # expert parallel (MoE): rank files mp_rank_TT[_PPP]_EEE, each with its E/ep local experts
    experts: str = SEQUENTIAL  # legacy expert module (``layout.experts``): SequentialMLP or GroupedMLP


def plan_copy_target(source: RawSource, *, fmt: str, tp: int, pp: int, vpp: int, divisible_by: int,
                     first: int | None = None, last: int | None = None, ep: int = 1,
                     grouped_gemm: bool = False) -> CopyTarget:
    """Validate the target layout for the model as the torch path does, in its order and with its
    messages (ParallelConfigError / ValueError name the numbers). Every model and expert layout is written
    (MoE: EP rank files, SequentialMLP, GroupedMLP -- each expert transposed, ``ops.Transposed`` --, Transformer
    Engine's grouped names for the hybrids); ``Unsupported`` (the torch path writes it) for tensors in several
    dtypes and a hybrid's output norm whose Megatron value has no one answer (a NaN)."""
    cfg = source.cfg
    require_megatron_layout(cfg, source.path)
    check_target_stages(cfg.num_hidden_layers, pp, vpp, first, last)
    validate_target_layout(cfg, fmt, tp=tp, pp=pp, vpp=vpp, first=first, last=last)
    check_ep_target(cfg, tp, ep, grouped_gemm)
    try:
        check_tower_tp(cfg, tp, source.path)  # a conditional-generation hybrid's vision tower, as the torch path
    except LayoutError as exc:
        raise ValueError(str(exc)) from None
    tag = source.dtype()
    padded = megatron_padded_vocab(cfg.vocab_size, tp, divisible_by)
    args = target_arg_fields(source.hf_config, cfg, tp=tp, pp=pp, vpp=vpp, padded_vocab=padded,
                             dtype_name=TAG_TO_TORCH_NAME[tag], fmt="torch" if fmt == "megatron" else "torch_dist",
                             divisible_by=divisible_by, first=first, last=last, ep=ep, grouped_gemm=grouped_gemm,
                             mtp_layers=getattr(source.wmap, "mtp_layers", 0))
    source.plan_megatron_values()  # a hybrid's output norms (HF - 1): Unsupported for a NaN, before any write
    layout = MegatronLayout(cfg.num_hidden_layers, pp, vpp, first, last, "target")
    iteration = getattr(source, "iteration", None)
    return CopyTarget(fmt, tp, pp, vpp, padded, tag, layout, args, iteration if isinstance(iteration, int) else None,
                      hf_shapes(cfg, source.wmap), ep, expert_module(source.wmap, grouped_gemm))


def expert_module(wmap, grouped_gemm: bool) -> str:
    """The legacy expert module a target is written with, as the torch path picks it: SequentialMLP, or with
    ``grouped_gemm`` megatron-core's GroupedMLP -- Transformer Engine's TEGroupedMLP for the hybrids, whose
    checkpoints are the Transformer-Engine spec's."""
    if not grouped_gemm:
        return SEQUENTIAL
    return TE_GROUPED if is_hybrid(wmap) else GROUPED_GEMM


def _args_node(target: CopyTarget) -> pw.NewObj:
    fields = dict(target.args)
    fields["params_dtype"] = pw.Global("torch", fields["params_dtype"])
    return pw.namespace(fields)


@dataclass
class _FilePlan:
    path: str
    size: int
    headers: list[tuple[int, bytes]]
    work: list[tuple[int, list[Op], int]]  # (offset, ops, nbytes)


def _legacy_file(source: RawSource, target: CopyTarget, directory: Path, p: int, t: int,
                 bands: dict[tuple, dict], e: int = 0) -> _FilePlan:
    """Rank file (p, t, e): the non-expert tensors of stage ``p`` (in every EP rank's file, as Megatron
    writes them) and EP rank ``e``'s local experts. Column-parallel shards (``linear_proj``, ``linear_fc2``)
    are not filled per file: their source rows are read once for all TP (and EP) ranks holding them
    (``bands``, see ``scatter_bands``)."""
    storages: list[tuple[list[Op] | None, int]] = []
    state: dict[str, Any] = {}
    scattered: list[tuple[int, tuple]] = []

    def add(key: str, entry: WeightEntry, chunk_name: str, rank: int | None = None) -> pw.Reduce:
        shape, ops = shard_ops(source, entry, target.hf_shapes, target.padded_vocab, target.tp, t, key)
        full = megatron_full_shape(entry, target.hf_shapes, source.cfg, target.padded_vocab)
        group = (p, chunk_name, key, rank)  # an expert's local key names another expert on each EP rank
        if group not in bands and target.tp > 1 and tp_split_kind(entry, len(full)) == COL1 and any(
                isinstance(op, Interleave) for op in ops) and band_scatterable(ops):
            # this rank's band cuts through source rows (an HF or torch_dist source, or a TP
            # increase): fill all ranks' bands from one read of each row. Bands that are whole
            # source blocks (the same or a lower TP) stay file-to-file copies.
            segments = full_segments(entry, source.cfg, target.hf_shapes, target.padded_vocab)
            width = row_nbytes(full, source.planned[entry.hf[0]].dtype)
            bands[group] = {"ops": full_rows_ops(source, segments, [(0, full[0])], 0, width), "width": width,
                            "outputs": [[] for _ in range(target.tp)]}
        if group in bands:
            scattered.append((len(storages), group))
            storages.append((None, sum(op.nbytes for op in ops)))
        else:
            storages.append((ops, sum(op.nbytes for op in ops)))
        return pw.tensor(str(len(storages) - 1), target.tag, shape)

    def add_ops(shape: tuple[int, ...], ops: list[Op]) -> pw.Reduce:
        storages.append((ops, sum(op.nbytes for op in ops)))
        return pw.tensor(str(len(storages) - 1), target.tag, shape)

    hybrid = is_hybrid(source.wmap)
    for v in range(target.vpp):
        name = "model" if target.vpp == 1 else f"model{v}"
        chunk = state.setdefault(name, {})
        for unit, local in target.layout.stage_units(p, v):
            grouped: dict[str, dict[int, tuple]] = {}  # GroupedMLP weight1/weight2: local expert -> its shard
            for entry, key, rank in unit_keys(source.wmap, unit, local, target.ep):  # a hybrid's MTP block on FINAL
                if rank is not None and rank != e:
                    continue
                stored, slot = stored_key(key, target.experts)  # (Transformer Engine's grouped names renamed)
                if slot is None:
                    chunk[stored] = add(key, entry, name, rank)
                else:
                    grouped.setdefault(stored, {})[slot] = shard_ops(source, entry, target.hf_shapes,
                                                                     target.padded_vocab, target.tp, t, key)
            for stored, by_slot in grouped.items():  # after the layer's other tensors, as the torch path
                chunk[stored] = add_ops(*grouped_weight(fc_of(stored), [by_slot[i] for i in sorted(by_slot)],
                                                        target.tag))
            modules = (legacy_extra_states(source.wmap, unit, local, target.ep, target.experts == SEQUENTIAL) if hybrid
                       else extra_state_modules(unit, local, source.wmap, target.ep, e, target.experts,
                                                te_norms=writes_te_norms(bridge=False, args=target.args)))
            if unit == EMBED and not hybrid:  # Qwen3-VL's tower, as the torch path writes it
                modules = modules + tower_modules(source.wmap)
            chunk.update({f"{m}._extra_state": None for m in modules})
        if source.cfg.tie_word_embeddings and target.pp > 1 and p == target.pp - 1 and v == target.vpp - 1:
            # Megatron's last stage keeps its own copy of the tied embedding as output_layer.weight.
            entry = source.wmap.first_entries[0]
            chunk["output_layer.weight"] = add("output_layer.weight", entry, name)
    obj = rank_file_object(_args_node(target), target.iteration, state)
    lay = layout_archive(pw.dumps(obj), [n for _, n in storages])
    path = str(directory / legacy_rank_dir_name(t, p, target.pp, e, target.ep) / RANK_FILE)
    for i, group in scattered:
        bands[group]["outputs"][t].append((path, lay.storage_offsets[i]))
    return _FilePlan(path, lay.end, lay.pieces,
                     [(off, ops, n) for off, (ops, n) in zip(lay.storage_offsets, storages) if ops is not None])


def _dist_files(source: RawSource, target: CopyTarget, directory: Path) -> tuple[list[_FilePlan], bytes]:
    """The .distcp files (one archive per chunk) and the ``.metadata`` pickle."""
    units = [u for u, _ in source.units()]
    n_files = max(1, min(DIST_DATA_FILES, len(units)))
    L = source.cfg.num_hidden_layers
    E = source.cfg.moe.num_experts if source.cfg.moe is not None else 0
    stacked = stacks_layers(source.wmap, L)
    prefix = layer_prefix(source.wmap)  # decoder.layers. (language_model.decoder.layers. for Qwen3-VL)
    te_norms = writes_te_norms(bridge=False, args=target.args)  # the TE spec's own norms: an _extra_state each
    extra = archive_bytes(pw.dumps([None]))
    tensors: dict[str, dict] = {}
    bytes_keys: list[tuple[str, str, int, int]] = []
    plans = []
    for i in range(n_files):
        name = f"__{i}_0.distcp"
        pos, headers, work = 0, [], []
        for unit in units[i::n_files]:
            if is_hybrid(source.wmap):
                pos = _hybrid_dist_unit(source, target, unit, name, pos, headers, work, tensors, bytes_keys, extra)
                continue
            layer = None if unit in (EMBED, FINAL) else int(unit)
            for entry, key in unit_megatron_keys(source.wmap, unit, layer):
                full, ops = shard_ops(source, entry, target.hf_shapes, target.padded_vocab, 1, 0, key)
                block = tower_block(key)
                if block is not None:  # Qwen3-VL's tower blocks / DeepStack mergers stacked [n, ...]
                    gkey, gshape = block[0], (tower_depth(source.wmap, key), *full)
                    offsets, chunk = (block[1], *(0,) * len(full)), (1, *full)
                elif layer is None:
                    gkey, gshape, offsets, chunk = key, full, (0,) * len(full), full
                else:  # stacked [L, ...] (experts [L, E, ...]), or per layer between dense and MoE layers
                    gkey, gshape, offsets, chunk = dist_placement(source.wmap, key, layer, full, num_layers=L,
                                                                  experts=E, stacked=stacked, args=target.args,
                                                                  prefix=prefix)
                nbytes = sum(op.nbytes for op in ops)
                lay = layout_archive(pw.dumps(pw.tensor("0", target.tag, chunk)), [nbytes], base=pos)
                headers += lay.pieces
                work.append((lay.storage_offsets[0], ops, nbytes))
                meta = tensors.setdefault(gkey, {"size": gshape, "chunks": []})
                meta["chunks"].append((offsets, chunk, name, pos, lay.size))
                pos = lay.end
            extras = dist_tower_extra_states(source.wmap) if unit == EMBED else []
            if layer is not None:
                extras = layer_extra_states(source.wmap, layer, num_layers=L, experts=E, stacked=stacked, prefix=prefix)
                if te_norms:
                    extras += te_norm_extra_states(source.wmap, layer, num_layers=L, stacked=stacked, prefix=prefix)
            elif unit == FINAL and te_norms:
                extras = final_norm_extra_states(prefix)
            for module, suffix in extras:
                bytes_keys.append((f"{module}._extra_state/{suffix}", name, pos, len(extra)))
                headers.append((pos, extra))
                pos += len(extra)
        plans.append(_FilePlan(str(directory / name), pos, headers, work))
    return plans, pw.dumps(dist_metadata(tensors, bytes_keys, target.tag))


def _hybrid_dist_unit(source: RawSource, target: CopyTarget, unit, name: str, pos: int, headers: list, work: list,
                      tensors: dict, bytes_keys: list, extra: bytes) -> int:
    """A Gated DeltaNet hybrid's unit in data file ``name`` from offset ``pos``, as the torch path's
    ``_put_hybrid_unit`` lays it out (``layout.hybrid``: every layer under its global number, ``in_proj`` /
    ``conv1d`` one global tensor per component, experts ``[E, ...]`` per layer, the MTP layer as
    ``transformer_layer``, then an empty ``_extra_state`` per Transformer-Engine module); returns the offset
    after it."""
    layer = unit if isinstance(unit, int) else None
    for entry, key, _ in unit_keys(source.wmap, unit, layer, 1):
        full, ops = shard_ops(source, entry, target.hf_shapes, target.padded_vocab, 1, 0, key)
        start = 0
        block, expert = tower_block(key), dist_expert(key)
        stacked = block or expert  # (key, index along the leading dim) of a stacked tensor, or None
        for gkey, rows in [(stacked[0], None)] if stacked else dist_components(entry, key):
            shape = full if rows is None else (rows, *full[1:])
            gshape, offsets, chunk = shape, (0,) * len(shape), shape
            if stacked is not None:  # a vision-tower block [depth, ...] or an expert [E, ...]: its slice
                depth = tower_depth(source.wmap) if block else source.cfg.moe.num_experts
                gshape, offsets, chunk = (depth, *shape), (stacked[1], *offsets), (1, *shape)
            if rows is not None:
                segments = full_segments(entry, source.cfg, target.hf_shapes, target.padded_vocab)
                ops = full_rows_ops(source, segments, [(start, start + rows)], 0, row_nbytes(full, target.tag))
                start += rows
            nbytes = sum(op.nbytes for op in ops)
            lay = layout_archive(pw.dumps(pw.tensor("0", target.tag, chunk)), [nbytes], base=pos)
            headers += lay.pieces
            work.append((lay.storage_offsets[0], ops, nbytes))
            tensors.setdefault(gkey, {"size": gshape, "chunks": []})["chunks"].append(
                (offsets, chunk, name, pos, lay.size))
            pos = lay.end
    for module, suffix in dist_extra_states(source.wmap, unit):
        bytes_keys.append((f"{module}._extra_state/{suffix}", name, pos, len(extra)))
        headers.append((pos, extra))
        pos += len(extra)
    return pos


# ------------------------------------------------------------------------------------- writing


def _create(plan: _FilePlan) -> None:
    """The file at its final size with every header in place (the tensor bytes come later)."""
    Path(plan.path).parent.mkdir(parents=True, exist_ok=True)
    with open(plan.path, "wb") as f:  # a Python file object: a failed write keeps its errno
        f.truncate(plan.size)
        preallocate(f.fileno(), plan.size)  # blocks allocated now: the copy fills them (io.preallocate)
        for offset, data in plan.headers:
            f.seek(offset)
            f.write(data)


def _tasks(plans: list[_FilePlan], bands: dict[tuple, dict], workers: int, buffer_bytes: int) -> list[tuple]:
    """Fill tasks of about equal bytes (a big file is cut between several), then the column bands."""
    total = sum(n for p in plans for *_, n in p.work) + sum(op.nbytes for b in bands.values() for op in b["ops"])
    target = max(1, total // max(1, 2 * workers))
    per_file: list[list[tuple]] = []
    for plan in plans:
        tasks, batch, acc = [], [], 0
        for off, ops, n in plan.work:
            batch.append((off, ops))
            acc += n
            if acc >= target:
                tasks.append((fill_file, (plan.path, batch, buffer_bytes)))
                batch, acc = [], 0
        if batch:
            tasks.append((fill_file, (plan.path, batch, buffer_bytes)))
        per_file.append(tasks)
    # round-robin over the files: workers running at the same time write different files (writes to
    # one file serialize on its inode lock)
    ordered: list[tuple] = []
    for i in range(max(map(len, per_file), default=0)):
        ordered += [tasks[i] for tasks in per_file if i < len(tasks)]
    return ordered + band_tasks([(b["ops"], b["width"], b["outputs"]) for b in bands.values()], buffer_bytes)


def write_megatron_by_copy(source: RawSource, target: CopyTarget, directory: str, *, workers: int, progress: bool,
                           hf_config_dir: str | None = None, buffer_bytes: int = DEFAULT_BUFFER) -> None:
    """The Megatron checkpoint of ``source`` in ``directory`` (tracker, iteration folder, HF config)."""

    root = Path(directory)
    folder = iteration_folder(root, target.iteration)
    try:
        bands: dict[tuple, dict] = {}
        if target.fmt == "megatron":
            plans = [_legacy_file(source, target, folder, p, t, bands, e) for p in range(target.pp)
                     for e in range(target.ep) for t in range(target.tp)]
        else:
            plans, metadata = _dist_files(source, target, folder)
    except LayoutError as exc:
        raise CheckpointError(f"{source.path}: {exc}") from exc
    for plan in plans:
        _create(plan)
    run_tasks(_tasks(plans, bands, workers, thread_buffer(buffer_bytes, workers)), workers,
              "copying Megatron tensors", progress, threads=True)
    if target.fmt != "megatron":
        (folder / ".metadata").write_bytes(metadata)
        common = {"args": _args_node(target), "checkpoint_version": 3.0, "iteration": target.iteration or 0}
        (folder / "common.pt").write_bytes(archive_bytes(pw.dumps(common)))
        (folder / "metadata.json").write_text(json.dumps(DIST_METADATA_JSON))
    # The HF config beside the iteration folders keeps what Megatron args cannot say (real vocab size,
    # RoPE scaling, token ids); our readers pick it up, Megatron ignores it.
    cfg_dir = root / HF_CONFIG_DIR
    cfg_dir.mkdir()
    write_config_dir(source.hf_config, cfg_dir)  # with generation config, tokenizer files, chat template

__all__ = ["CopyTarget", "plan_copy_target", "write_megatron_by_copy"]
