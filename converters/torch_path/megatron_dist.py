"""Megatron ``torch_dist`` checkpoints on the torch path: a reader over the format's validating reader,
and the writer, without torch.distributed or megatron-core.

Layout: see ``converters/formats/megatron_dist`` (metadata.json, .metadata, __R_I.distcp chunks,
common.pt; tensors global, uniform layers stacked). Reading fetches only the chunks overlapping the
requested layer, mapped from their validated byte locations, so memory stays at one unit. Writing
streams each unit's chunks to the task's own .distcp file and builds ``.metadata`` from the
recorded offsets at the end.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from converters.formats.megatron_bridge import bridge_common_state
from converters.formats.megatron_dist import DistCheckpoint
from converters.layout.hybrid import (
    dist_components,
    dist_expert,
    dist_extra_states,
    dist_tower_extra_states,
    to_hf,
    tower_block,
    tower_depth,
    unit_absent,
)
from converters.layout.megatron import LayoutError
from converters.layout.model import (
    EMBED,
    FINAL,
    Unit,
    conversion_weight_map,
    is_hybrid,
    is_qwen3_vl,
    megatron_weight_map,
)
from converters.layout.stages import (
    DIST_DATA_FILES,
    DIST_METADATA_JSON,
    LOCAL_EXPERT,
    final_norm_extra_states,
    layer_extra_states,
    layer_prefix,
    stacked_key,
    stacks_layers,
    te_norm_extra_states,
    writer_norm_aliases,
    writes_te_norms,
)
from converters.runtime.tasks import run_tasks
from converters.torch_path.megatron_target import megatron_unit_tensors
from converters.torch_path.reader import TORCH_DTYPES, CheckpointReader, MappedFiles, ReaderInfo, reopen
from models.common.errors import CheckpointError


class DistReader(CheckpointReader):
    megatron = True

    def __init__(self, path: str | os.PathLike, *, arch: str | None = None, hf_config_dir: str | None = None,
                 vocab_size: int | None = None) -> None:
        self.path = str(path)
        self._remember_args(self.path, arch=arch, hf_config_dir=hf_config_dir, vocab_size=vocab_size)
        self.ckpt = ckpt = DistCheckpoint(self.path, arch=arch, hf_config_dir=hf_config_dir, vocab_size=vocab_size)
        self.it_dir, self.args, self.common, self.tensors = ckpt.it_dir, ckpt.args, ckpt.common, ckpt.tensors
        # the model's own weight map for writers (vLLM packs the vision MLP's gate/up); the checkpoint's
        # Megatron names (Megatron-Bridge's for vision-language models) only for reading
        self.hf_config, self.arch, self.cfg = ckpt.hf_config, ckpt.arch, ckpt.cfg
        self.wmap = conversion_weight_map(self.arch, self.cfg, getattr(ckpt.wmap, "mtp_layers", 0))
        self.skipped, self.padded_vocab = ckpt.skipped, ckpt.padded_vocab
        lay: dict[str, Any] = ckpt.layout or {"tp": None, "pp": None, "vpp": None}
        files = sorted({c.file for t in self.tensors.values() for c in t.chunks})
        self.info = ReaderInfo("megatron-dist", self.arch.name,
                               {"saved_with_tp": lay["tp"], "saved_with_pp": lay["pp"], "saved_with_vpp": lay["vpp"],
                                **({"saved_with_ep": lay.get("ep"), "experts_stored": "stacked per layer and expert"}
                                   if self.cfg.moe is not None else {}),
                                "padded_vocab": self.padded_vocab, "iteration": ckpt.iteration},
                               len(files), TORCH_DTYPES.get(ckpt.dtype, torch.float32))
        self._files = MappedFiles()

    def validate(self) -> None:
        """``DistCheckpoint.validate``: tensors, shapes, chunk tiling, data files and archives (see there)."""
        self.ckpt.validate()

    def read_tensor(self, key: str, index: int | tuple[int, ...] | None) -> torch.Tensor:
        """The global tensor ``key`` (or its slice ``[index]`` along the leading dims: a layer, or a
        layer and an expert), from overlapping chunks only."""
        meta = self.tensors.get(key)
        if meta is None:
            raise CheckpointError(f"{self.it_dir}: missing tensor {key}")
        size = meta.size
        lo = [0] * len(size)
        hi = list(size)
        lead = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        for d, i in enumerate(lead):
            if not 0 <= i < size[d]:
                raise CheckpointError(f"{self.it_dir}: {key} has global shape {size}, no index {i} along dim {d}")
            lo[d], hi[d] = i, i + 1
        out = torch.empty([h - low for low, h in zip(lo, hi)], dtype=TORCH_DTYPES[meta.dtype])
        covered = 0
        for chunk in meta.chunks:
            c_lo = list(chunk.offsets)
            c_hi = [o + s for o, s in zip(chunk.offsets, chunk.sizes)]
            o_lo = [max(a, b) for a, b in zip(lo, c_lo)]
            o_hi = [min(a, b) for a, b in zip(hi, c_hi)]
            if any(a >= b for a, b in zip(o_lo, o_hi)):
                continue
            data = self._files.tensor(self.ckpt.chunk(key, chunk))
            src = data[tuple(slice(a - c, b - c) for a, b, c in zip(o_lo, o_hi, c_lo))]
            out[tuple(slice(a - low, b - low) for a, b, low in zip(o_lo, o_hi, lo))] = src
            covered += src.numel()
        if covered != out.numel():
            raise CheckpointError(f"{self.it_dir}: chunks of {key} cover {covered} of {out.numel()} elements")
        return out[(0,) * len(lead)] if lead else out

    def read_unit(self, unit: Unit) -> dict[str, torch.Tensor]:
        stored = self.ckpt.wmap
        out = {n: torch.zeros(shape, dtype=self.info.dtype) for n, shape in unit_absent(stored, unit).items()}
        for entry, keys, idx in self.ckpt.unit_keys(unit):
            parts = [self.read_tensor(key, idx) for key, _ in keys]  # a packed entry's components, in order
            try:
                full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
                out.update(zip(entry.hf, to_hf(entry, full, self.cfg)))
            except LayoutError as exc:
                raise CheckpointError(f"{self.it_dir}: {exc}") from exc
        return out


# ---------------------------------------------------------------------------------------------- writing


def _torch_save_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_dist_units(reopen_args: tuple, target, directory: str, units: list, file_name: str) -> list[tuple]:
    """Write ``units`` into ``file_name``; returns (key, global_shape, dtype, offsets, sizes, storage) records."""
    reader = reopen(reopen_args)
    L = reader.cfg.num_hidden_layers
    # a Bridge target's names (Bridge's for vision-language models; Qwen3-VL's in every Megatron format), a hybrid's
    # MTP block included
    qwen3_vl = is_qwen3_vl(reader.cfg)
    wmap = megatron_weight_map(reader.arch, reader.cfg, getattr(reader.wmap, "mtp_layers", 0)) \
        if target.bridge or qwen3_vl else reader.wmap
    prefix = layer_prefix(wmap)  # decoder.layers. (language_model.decoder.layers. for Bridge's VL models)
    # megatron-core stacks layers only when they are uniform: with dense layers between MoE ones
    # every key carries its global layer number (norms still under their TE names)
    stacked = stacks_layers(wmap, L)
    E = reader.cfg.moe.num_experts if reader.cfg.moe is not None else 0
    te_norms = writes_te_norms(bridge=target.bridge, args=target.args)
    records = []

    def put(key: str, gshape, dtype, offsets, chunk_shape, payload) -> None:
        raw = _torch_save_bytes(payload)
        records.append((key, gshape, dtype, offsets, chunk_shape, (file_name, f.tell(), len(raw))))
        f.write(raw)

    with open(Path(directory) / file_name, "wb") as f:
        if is_hybrid(wmap):  # per-layer keys, packed components, the MTP block
            for unit in units:
                _put_hybrid_unit(put, reader, target, wmap, unit)
            units = []
        for unit in units:
            layer = None if unit in (EMBED, FINAL) else int(unit)
            for _entry, key, full in megatron_unit_tensors(reader, unit, layer, target.padded_vocab, target.dtype,
                                                           wmap=wmap):
                expert, block = LOCAL_EXPERT.search(key), tower_block(key)
                lead: tuple[int, ...] = ()
                if block is not None:  # Qwen3-VL's tower blocks / DeepStack mergers stacked [n, ...]
                    gkey, gshape, offsets, lead = block[0], (tower_depth(wmap, key),), (block[1],), (1,)
                elif layer is None:
                    gkey, gshape, offsets = key, (), ()
                elif expert is not None:  # experts stacked per layer and per global expert
                    e = int(expert.group(1))
                    gkey = key.replace(expert.group(0), ".mlp.experts.experts.")
                    if stacked:
                        gkey = gkey.replace(f"layers.{layer}.", "layers.", 1)
                        gshape, offsets, lead = (L, E), (layer, e), (1, 1)
                    else:
                        gshape, offsets, lead = (E,), (e,), (1,)
                else:
                    aliases = writer_norm_aliases(wmap, layer, bridge=target.bridge, args=target.args, fmt="torch_dist")
                    gkey = stacked_key(key.replace(f"layers.{layer}.", "layers.{i}.", 1), aliases)
                    if stacked:
                        gshape, offsets, lead = (L,), (layer,), (1,)
                    else:
                        gkey, gshape, offsets = gkey.replace(prefix, f"{prefix}{layer}.", 1), (), ()
                chunk = full.reshape(*lead, *full.shape).contiguous()
                put(gkey, (*gshape, *full.shape), full.dtype, (*offsets, *(0,) * full.dim()), tuple(chunk.shape),
                    chunk)
            extras = dist_tower_extra_states(wmap) if unit == EMBED else []
            if layer is not None:
                extras = layer_extra_states(wmap, layer, num_layers=L, experts=E, stacked=stacked, prefix=prefix)
                if te_norms:  # the TE spec's own norms keep an _extra_state too
                    extras += te_norm_extra_states(wmap, layer, num_layers=L, stacked=stacked, prefix=prefix)
            elif unit == FINAL and te_norms:
                extras = final_norm_extra_states(prefix)  # the block's final norm: TE's TENorm
            for module, suffix in extras:
                put(f"{module}._extra_state/{suffix}", None, None, None, None, [None])
    reader.close()
    return records


def _put_hybrid_unit(put, reader: CheckpointReader, target, wmap, unit: Unit) -> None:
    """A Gated DeltaNet hybrid's unit as megatron-core saves it (``layout.hybrid``): every layer under its
    global number, ``in_proj`` / ``conv1d`` one global tensor per component, experts ``[E, ...]`` per layer,
    the MTP block's layer as ``transformer_layer``, an empty ``_extra_state`` per Transformer-Engine module, a
    conditional-generation checkpoint's vision-tower blocks stacked (``layout.hybrid.tower_block``)."""
    layer = unit if isinstance(unit, int) else None
    E = reader.cfg.moe.num_experts if reader.cfg.moe is not None else 0
    for entry, key, full in megatron_unit_tensors(reader, unit, layer, target.padded_vocab, target.dtype, wmap=wmap):
        expert, block = dist_expert(key), tower_block(key)
        if block is not None:  # the vision tower's blocks stacked [depth, ...]
            chunk = full.reshape(1, *full.shape).contiguous()
            put(block[0], (tower_depth(wmap), *full.shape), full.dtype, (block[1], *(0,) * full.dim()),
                tuple(chunk.shape), chunk)
            continue
        if expert is not None:
            chunk = full.reshape(1, *full.shape).contiguous()
            put(expert[0], (E, *full.shape), full.dtype, (expert[1], *(0,) * full.dim()), tuple(chunk.shape), chunk)
            continue
        start = 0
        for name, rows in dist_components(entry, key):
            part = full if rows is None else full[start:start + rows].clone()  # a slice saves its whole storage
            start += rows or 0
            put(name, tuple(part.shape), part.dtype, (0,) * part.dim(), tuple(part.shape), part)
    for module, suffix in dist_extra_states(wmap, unit):
        put(f"{module}._extra_state/{suffix}", None, None, None, None, [None])


def write_dist(reader: CheckpointReader, target, directory: str, *, workers: int, progress: bool) -> None:
    """torch_dist checkpoint in ``directory`` (the iteration folder)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    units = reader.units()
    # The number of data files is part of the plan (not of --workers), so output bytes never depend
    # on how many processes wrote them.
    n_files = max(1, min(DIST_DATA_FILES, len(units)))
    groups = [units[i::n_files] for i in range(n_files)]
    tasks = [(write_dist_units, (reader.reopen_args(), target, directory, g, f"__{i}_0.distcp"))
             for i, g in enumerate(groups)]
    results = run_tasks(tasks, workers, "writing torch_dist", progress)
    state_md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for records in results:
        for key, gshape, dtype, offsets, sizes, (fname, off, length) in records:
            if gshape is None:
                state_md[key] = BytesStorageMetadata()
                storage[MetadataIndex(key)] = _StorageInfo(fname, off, length)
                continue
            meta = state_md.setdefault(
                key, TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(gshape), []))
            meta.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            storage[MetadataIndex(key, torch.Size(offsets))] = _StorageInfo(fname, off, length)
    for meta in state_md.values():
        if isinstance(meta, TensorStorageMetadata):
            meta.chunks.sort(key=lambda c: tuple(c.offsets))
    metadata = Metadata(state_dict_metadata=dict(sorted(state_md.items())), planner_data=None, storage_data=storage)
    with open(Path(directory) / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    common: dict[str, Any] = {"args": target.args, "checkpoint_version": 3.0, "iteration": target.iteration or 0}
    if target.bridge:  # no Megatron args: Bridge describes the model in run_config.yaml
        common = bridge_common_state(target.iteration or 0)
    torch.save(common, Path(directory) / "common.pt")
    (Path(directory) / "metadata.json").write_text(json.dumps(DIST_METADATA_JSON))


__all__ = ["DistReader", "write_dist"]
