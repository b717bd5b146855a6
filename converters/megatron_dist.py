"""Megatron ``torch_dist`` checkpoints, read and written without torch.distributed or megatron-core.

Layout (megatron-core ``dist_checkpointing`` over ``torch.distributed.checkpoint``):
  metadata.json  ``{"sharded_backend": "torch_dist", ...}``
  .metadata      pickled ``torch.distributed.checkpoint.metadata.Metadata``: per key the global
                 shape and the chunks (offsets, sizes) stored, and where each chunk's bytes are
  __R_I.distcp   chunk payloads, each one ``torch.save``'d tensor at (offset, length)
  common.pt      non-tensor state: ``args``, ``checkpoint_version``, ``iteration``
Tensors are global (unsharded). Uniform layers are stacked: ``decoder.layers.<param>`` has a
leading ``num_layers`` dim (global layer index, VPP chunks included). Norms carry the
Transformer-Engine names (``self_attention.linear_qkv.layer_norm_weight``, ...). ``linear_fc1`` is
``[gate; up]``; ``linear_qkv`` is interleaved per query group.

Reading fetches only the chunks overlapping the requested layer (byte ranges of the .distcp files),
so memory stays at one unit. Writing streams each unit's chunks to the task's own .distcp file and
builds ``.metadata`` from the recorded offsets at the end.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from converters.checkpoint import EMBED, FINAL, CheckpointReader, ReaderInfo, Unit, reopen
from converters.megatron_files import args_layout, hf_config_from_args, resolve_iteration_dir
from converters.megatron_layout import LayoutError, megatron_full_shape, megatron_to_hf
from converters.megatron_moe import dist_expert_key
from converters.megatron_sources import check_config_against_dist, config_without_args, is_model_key, skipped_summary
from converters.megatron_stages import (
    DIST_DATA_FILES,
    DIST_METADATA_JSON,
    LAYER_PREFIX,
    absent_tensors,
    dist_key,
    not_in_megatron,
    stacked_key,
)
from converters.safe_pickle import safe_pickle_load, safe_torch_load
from models.common.sources import CheckpointError


class DistReader(CheckpointReader):
    megatron = True
    def __init__(self, path: str | os.PathLike, *, arch: str | None = None, hf_config_dir: str | None = None,
                 vocab_size: int | None = None) -> None:
        self.path = str(path)
        self._remember_args(self.path, arch=arch, hf_config_dir=hf_config_dir, vocab_size=vocab_size)
        self.it_dir = resolve_iteration_dir(Path(path))
        meta_json = self.it_dir / "metadata.json"
        try:
            backend = json.loads(meta_json.read_text()).get("sharded_backend")
        except (OSError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{meta_json}: unreadable ({exc})") from exc
        if backend != "torch_dist":
            raise CheckpointError(f"{meta_json}: sharded_backend={backend!r}, only torch_dist is supported")
        md_path = self.it_dir / ".metadata"
        try:
            with open(md_path, "rb") as f:
                self.md = safe_pickle_load(f)
            self.tensors = {k: v for k, v in self.md.state_dict_metadata.items() if hasattr(v, "chunks")}
        except Exception as exc:
            raise CheckpointError(f"{md_path}: missing or corrupt ({type(exc).__name__}: {exc})") from exc
        self.storage = {(idx.fqn, tuple(idx.offset) if idx.offset is not None else None): info
                        for idx, info in self.md.storage_data.items()}
        self.common: dict = {}
        self.args = self._read_args()
        where = str(self.it_dir)
        if self.args is None:  # dist_checkpointing.save alone, verl, Megatron-Bridge: an HF config describes it
            config = config_without_args(hf_config_dir, where)
            lay: dict[str, Any] = {"tp": None, "pp": None, "vpp": None}
        else:
            config = hf_config_from_args(self.args, arch=arch, hf_config_dir=hf_config_dir, vocab_size=vocab_size,
                                         where=where)
            lay = args_layout(self.args)
        self._set_model(config, self.path)
        config_path = f"{hf_config_dir}/config.json" if hf_config_dir else "the config from the Megatron args"
        check_config_against_dist(self.cfg, {k: tuple(v.size) for k, v in self.tensors.items()}, config_path, where)
        self.skipped = skipped_summary(self.md.state_dict_metadata)
        emb = self.tensors.get("embedding.word_embeddings.weight")
        self.padded_vocab = int(emb.size[0]) if emb is not None else self.cfg.vocab_size
        files = sorted({info.relative_path for info in self.storage.values()})
        dtype = next((v.properties.dtype for k, v in self.tensors.items() if is_model_key(k)), torch.float32)
        iteration = getattr(self.args, "iteration", None) if self.args is not None else None
        if iteration is None:  # Megatron-Bridge keeps it in common.pt only
            iteration = self.common.get("iteration")
        self.info = ReaderInfo("megatron-dist", self.arch.name,
                               {"saved_with_tp": lay["tp"], "saved_with_pp": lay["pp"], "saved_with_vpp": lay["vpp"],
                                **({"saved_with_ep": lay.get("ep"), "experts_stored": "stacked per layer and expert"}
                                   if self.cfg.moe is not None else {}),
                                "padded_vocab": self.padded_vocab, "iteration": iteration},
                               len(files), dtype)

    def _read_args(self) -> Any:
        """Megatron-LM's args from common.pt (or an 'args' item); None when the checkpoint has none."""
        common = self.it_dir / "common.pt"
        if common.exists():
            try:
                data = safe_torch_load(common, mmap=False)
            except Exception as exc:
                raise CheckpointError(f"{common}: unreadable ({type(exc).__name__}: {exc})") from exc
            if isinstance(data, dict):
                self.common = data
                if data.get("args") is not None:
                    return data["args"]
        if ("args", None) in self.storage:  # newer Megatron keeps common state inside the checkpoint
            return safe_torch_load(io.BytesIO(self._read_bytes("args", None)), mmap=False)
        return None

    def _read_bytes(self, fqn: str, offset) -> bytes:
        info = self.storage.get((fqn, offset))
        if info is None:
            raise CheckpointError(f"{self.it_dir}: .metadata lists chunk {offset} of {fqn} but no storage for it")
        path = self.it_dir / info.relative_path
        try:
            with open(path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read ({exc})") from exc
        if len(data) != info.length:
            raise CheckpointError(f"{path}: truncated: chunk of {fqn} needs bytes "
                                  f"{info.offset}..{info.offset + info.length}")
        return data

    def read_tensor(self, key: str, index: int | tuple[int, ...] | None) -> torch.Tensor:
        """The global tensor ``key`` (or its slice ``[index]`` along the leading dims: a layer, or a
        layer and an expert), from overlapping chunks only."""
        meta = self.tensors.get(key)
        if meta is None:
            raise CheckpointError(f"{self.it_dir}: missing tensor {key}")
        size = tuple(meta.size)
        lo = [0] * len(size)
        hi = list(size)
        lead = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        for d, i in enumerate(lead):
            if not 0 <= i < size[d]:
                raise CheckpointError(f"{self.it_dir}: {key} has global shape {size}, no index {i} along dim {d}")
            lo[d], hi[d] = i, i + 1
        out = torch.empty([h - low for low, h in zip(lo, hi)], dtype=meta.properties.dtype)
        covered = 0
        for chunk in meta.chunks:
            c_lo = list(chunk.offsets)
            c_hi = [o + s for o, s in zip(chunk.offsets, chunk.sizes)]
            o_lo = [max(a, b) for a, b in zip(lo, c_lo)]
            o_hi = [min(a, b) for a, b in zip(hi, c_hi)]
            if any(a >= b for a, b in zip(o_lo, o_hi)):
                continue
            raw = self._read_bytes(key, tuple(chunk.offsets))
            try:
                data = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            except Exception as exc:
                raise CheckpointError(f"{self.it_dir}: corrupt chunk {tuple(chunk.offsets)} of {key} ({exc})") from exc
            src = data[tuple(slice(a - c, b - c) for a, b, c in zip(o_lo, o_hi, c_lo))]
            out[tuple(slice(a - low, b - low) for a, b, low in zip(o_lo, o_hi, lo))] = src
            covered += src.numel()
        if covered != out.numel():
            raise CheckpointError(f"{self.it_dir}: chunks of {key} cover {covered} of {out.numel()} elements")
        return out[(0,) * len(lead)] if lead else out

    def _layer_keys(self, layer: int) -> list[tuple[Any, str, Any]]:
        """(plain entry, torch_dist key, index) of every stored tensor of a layer; experts one entry
        per global expert, at ``(layer, expert)`` of the stacked key or ``(expert,)`` of a per-layer one."""
        out = []
        templates = self.wmap.layer_templates(layer)
        skipped = not_in_megatron(templates)
        for tmpl in templates:
            if tmpl.param in skipped:
                continue  # no shared expert: Megatron stores nothing
            entry = tmpl.format(layer)
            if tmpl.experts:
                for e in range(tmpl.experts):
                    key, idx = dist_expert_key(tmpl.megatron, layer, e, self.tensors)
                    out.append((entry.expert(e), key, idx))
            else:
                key, idx = dist_key(tmpl.megatron, layer, self.tensors)
                out.append((entry, key, idx))
        return out

    def _expected(self) -> list[tuple[str, tuple[int, ...]]]:
        """(torch_dist key, global shape) of every tensor a conversion needs."""
        shapes = self.hf_shapes()
        L = self.cfg.num_hidden_layers
        out: dict[str, tuple[int, ...]] = {}
        for entry in self.wmap.first_entries + self.wmap.last_entries:
            out[entry.megatron] = megatron_full_shape(entry, shapes, self.cfg, self.padded_vocab)
        experts = self.cfg.moe.num_experts if self.cfg.moe is not None else 0
        for i in range(L):
            for entry, key, idx in self._layer_keys(i):
                full = megatron_full_shape(entry, shapes, self.cfg, self.padded_vocab)
                lead = () if idx is None else (L,) if isinstance(idx, int) else (L, experts)[-len(idx):]
                out.setdefault(key, (*lead, *full))
        return list(out.items())

    def validate(self) -> None:
        expected = self._expected()
        problems = []
        for key, shape in expected:
            meta = self.tensors.get(key)
            if meta is None:
                problems.append(f"missing tensor {key}")
            elif tuple(meta.size) != tuple(shape):
                problems.append(f"tensor {key} has global shape {tuple(meta.size)}, the config implies {tuple(shape)}")
        names = {k for k, _ in expected}
        tied_copy = {"output_layer.weight"} if self.cfg.tie_word_embeddings else set()
        unused = sorted(k for k in self.tensors if k not in names and k not in tied_copy and is_model_key(k))
        if unused:
            problems.append(f"unused tensor(s) {', '.join(unused[:8])} (not part of a {self.arch.name} model)")
        # files holding model bytes only: optimizer/RNG state may live (or be missing) elsewhere
        for info in {(i.relative_path, i.offset + i.length) for (fqn, _), i in self.storage.items()
                     if is_model_key(fqn)}:
            path = self.it_dir / info[0]
            if not path.exists():
                problems.append(f"missing data file {info[0]}")
            elif path.stat().st_size < info[1]:
                problems.append(f"truncated data file {info[0]} ({path.stat().st_size} bytes, needs {info[1]})")
        if problems:
            raise CheckpointError(f"{self.it_dir}: " + "; ".join(sorted(set(problems))[:10]))

    def read_unit(self, unit: Unit) -> dict[str, torch.Tensor]:
        if unit in (EMBED, FINAL):
            entries = [(e, e.megatron, None)
                       for e in (self.wmap.first_entries if unit == EMBED else self.wmap.last_entries)]
        else:
            entries = self._layer_keys(int(unit))
        out = {n: torch.zeros(shape, dtype=self.info.dtype) for n, shape in absent_tensors(self.wmap, unit).items()}
        for entry, key, idx in entries:
            try:
                out.update(zip(entry.hf, megatron_to_hf(entry, self.read_tensor(key, idx), self.cfg)))
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
    from converters.megatron_write import megatron_unit_tensors

    reader = reopen(reopen_args)
    L = reader.cfg.num_hidden_layers
    wmap = reader.wmap
    # megatron-core stacks layers only when they are uniform: with dense layers between MoE ones
    # every key carries its global layer number (norms still under their TE names)
    stacked = not wmap.has_experts or len(wmap.moe_layers) == L
    E = reader.cfg.moe.num_experts if reader.cfg.moe is not None else 0
    records = []

    def put(key: str, gshape, dtype, offsets, chunk_shape, payload) -> None:
        raw = _torch_save_bytes(payload)
        records.append((key, gshape, dtype, offsets, chunk_shape, (file_name, f.tell(), len(raw))))
        f.write(raw)

    with open(Path(directory) / file_name, "wb") as f:
        for unit in units:
            layer = None if unit in (EMBED, FINAL) else int(unit)
            for _entry, key, full in megatron_unit_tensors(reader, unit, layer, target.padded_vocab, target.dtype):
                expert = _EXPERT.search(key)
                lead: tuple[int, ...] = ()
                if layer is None:
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
                    gkey = stacked_key(key.replace(f"layers.{layer}.", "layers.{i}.", 1))
                    if stacked:
                        gshape, offsets, lead = (L,), (layer,), (1,)
                    else:
                        gkey, gshape, offsets = gkey.replace(LAYER_PREFIX, f"{LAYER_PREFIX}{layer}.", 1), (), ()
                chunk = full.reshape(*lead, *full.shape).contiguous()
                put(gkey, (*gshape, *full.shape), full.dtype, (*offsets, *(0,) * full.dim()), tuple(chunk.shape),
                    chunk)
            if layer is not None:
                for module, suffix in _dist_extra_states(wmap, layer, L, E, stacked):
                    put(f"{module}._extra_state/{suffix}", None, None, None, None, [None])
    reader.close()
    return records


_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def _dist_extra_states(wmap, layer: int, L: int, E: int, stacked: bool) -> list[tuple[str, str]]:
    """(module, shard suffix) of the empty ``_extra_state`` items megatron-core writes for a layer:
    ``shard_{layer}_{L}`` stacked, ``shard_0_1`` per layer; experts ``shard_{layer}.{e}_{L}.{E}``
    stacked, ``shard_{e}_{E}`` per layer."""
    from converters.megatron_stages import LINEAR_MODULES

    prefix = LAYER_PREFIX if stacked else f"{LAYER_PREFIX}{layer}."
    where = f"shard_{layer}_{L}" if stacked else "shard_0_1"
    if layer not in wmap.moe_layers:
        return [(prefix + m, where) for m in LINEAR_MODULES]
    out = [(prefix + m, where) for m in LINEAR_MODULES[:2]]
    for j in (1, 2):
        out += [(f"{prefix}mlp.experts.experts.linear_fc{j}",
                 f"shard_{layer}.{e}_{L}.{E}" if stacked else f"shard_{e}_{E}") for e in range(E)]
    if not not_in_megatron(wmap.moe_layer_entries):
        out += [(f"{prefix}mlp.shared_experts.linear_fc{j}", where) for j in (1, 2)]
    return out


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

    from converters.tasks import run_tasks

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
    torch.save({"args": target.args, "checkpoint_version": 3.0, "iteration": target.iteration or 0},
               Path(directory) / "common.pt")
    (Path(directory) / "metadata.json").write_text(json.dumps(DIST_METADATA_JSON))


__all__ = ["DistReader", "write_dist"]
