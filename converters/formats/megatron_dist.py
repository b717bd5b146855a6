"""Megatron ``torch_dist`` checkpoints: the validating reader (``DistCheckpoint``) and the structure of
what a writer produces (``.metadata``, ``metadata.json``), side by side, without torch.

Layout (megatron-core ``dist_checkpointing`` over ``torch.distributed.checkpoint``):
  metadata.json  ``{"sharded_backend": "torch_dist", ...}``
  .metadata      pickled ``torch.distributed.checkpoint.metadata.Metadata``: per key the global
                 shape and the chunks (offsets, sizes) stored, and where each chunk's bytes are
  __R_I.distcp   chunk payloads, each one ``torch.save``'d tensor at (offset, length)
  common.pt      non-tensor state: ``args``, ``checkpoint_version``, ``iteration`` (or an ``args`` item)
Tensors are global (unsharded). Uniform layers are stacked: ``decoder.layers.<param>`` has a
leading ``num_layers`` dim (global layer index, VPP chunks included). Norms carry the
Transformer-Engine names (``self_attention.linear_qkv.layer_norm_weight``, ...). ``linear_fc1`` is
``[gate; up]``; ``linear_qkv`` is interleaved per query group.

``DistCheckpoint`` checks everything once, for both conversion paths: metadata.json names the
torch_dist backend; .metadata (restricted unpickling) lists tensors with integer shapes, a dtype and
chunks that tile each global tensor exactly, each chunk stored in a plain file of the folder at a
byte range inside it; the config (from the args, or an HF config for checkpoints without them)
against the global shapes before anything sized by it is built; exactly the tensors the model
needs, with their shapes; every chunk archive readable (``torch_zip``), holding a tensor of the
chunk's shape and dtype. Entries that are not model weights (optimizer, RNG state) are listed, not
read. Tensors come back as byte locations (``chunk``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from converters.formats.chunk_tiling import check_tiling
from converters.formats.hf_config import read_hf_config
from converters.formats.megatron_args import args_layout, check_args, hf_config_from_args, resolve_iteration_dir
from converters.formats.megatron_bridge import COMMON_STATE
from converters.formats.megatron_dist_check import EMBEDDING, OUTPUT, check_config_against_dist, is_model_key
from converters.formats.megatron_moe import arg_value, dist_expert_key
from converters.formats.pickles import Record, TorchDtype, read_pickle
from converters.formats.tensors import RawTensor, StridedTensor
from converters.formats.torch_zip import read_torch_archive
from converters.layout.hybrid import dist_lead, dist_unit_keys, tower_block
from converters.layout.megatron import megatron_full_shape
from converters.layout.model import (
    BRIDGE_TEXT_PREFIX,
    EMBED,
    FINAL,
    Unit,
    all_units,
    architecture_for,
    is_hybrid,
    model_from_config,
    mtp_layers_of,
)
from converters.layout.stages import dist_key, not_in_megatron
from models.common.errors import CheckpointError
from models.common.hf_files import plain_file_name, read_bounded
from models.common.weight_map import hf_shapes

MAX_METADATA_JSON_BYTES = 1 << 20
DCP = "torch.distributed.checkpoint.metadata"


@dataclass(frozen=True)
class DistChunk:
    """One stored chunk of a global tensor: its ``offsets`` and ``sizes`` in the global tensor and
    where its ``torch.save`` archive is (``file`` in the folder, byte ``offset``, ``length``)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DistTensor:
    size: tuple[int, ...]  # global shape
    dtype: str  # safetensors-style tag ("F32", "BF16", ...)
    chunks: tuple[DistChunk, ...]


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _counts(x: Any) -> tuple[int, ...] | None:
    """``x`` as a tuple of non-negative integers (a pickled ``torch.Size``), else None."""
    if isinstance(x, (tuple, list)) and all(_count(d) for d in x):
        return tuple(x)
    return None


def read_backend(meta_json: Path) -> None:
    """metadata.json must be a JSON object naming the torch_dist backend (CheckpointError otherwise)."""
    raw = read_bounded(meta_json, MAX_METADATA_JSON_BYTES, "a torch_dist metadata.json is a few bytes of JSON")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{meta_json}: not valid JSON ({exc})") from exc
    backend = data.get("sharded_backend") if isinstance(data, dict) else None
    if not isinstance(data, dict):
        raise CheckpointError(f"{meta_json}: a JSON {type(data).__name__}, not an object with 'sharded_backend'")
    if backend != "torch_dist":
        shown = repr(backend) if isinstance(backend, (str, int, float, type(None))) else type(backend).__name__
        raise CheckpointError(f"{meta_json}: sharded_backend={shown[:60]}, only torch_dist is supported")


def _dtype_of(properties: Any) -> str | None:
    """The dtype tag of a pickled ``TensorProperties`` (its state is a tuple, dtype first, or a dict)."""
    dtype = getattr(properties, "dtype", None)
    state = getattr(properties, "state", None)
    if dtype is None and isinstance(state, tuple) and state:
        dtype = state[0]
    return str(dtype) if isinstance(dtype, TorchDtype) else None


def parse_metadata(md: Any, md_path: Path) -> tuple[dict[str, DistTensor], dict[str, Any]]:
    """Tensors (key -> DistTensor) and byte items (key -> its storage entry) of an unpickled
    ``.metadata``, the model tensors' structure checked: integer shapes, a dtype, chunks inside the
    global shape, each with a storage entry at a byte range of a plain file of the folder.
    CheckpointError naming the file and the key otherwise. Entries that are not model weights
    (optimizer, RNG state) are listed with what can be read of them: they are never read."""
    entries = getattr(md, "state_dict_metadata", None)
    storage_data = getattr(md, "storage_data", None)
    if not isinstance(md, Record) or not isinstance(entries, dict) or not isinstance(storage_data, dict):
        raise CheckpointError(f"{md_path}: not a torch.distributed.checkpoint Metadata (unexpected structure)")
    storage: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for idx, info in storage_data.items():
        fqn, offset = getattr(idx, "fqn", None), getattr(idx, "offset", None)
        if not isinstance(fqn, str) or (offset is not None and _counts(offset) is None):
            raise CheckpointError(f"{md_path}: a storage entry with index {type(idx).__name__} (not fqn + offsets)")
        storage[(fqn, None if offset is None else tuple(offset))] = info
    tensors: dict[str, DistTensor] = {}
    objects: dict[str, Any] = {}
    for key, meta in entries.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{md_path}: an entry named by a {type(key).__name__}")
        if not hasattr(meta, "chunks"):
            objects[key] = storage.get((key, None))
            continue
        size, dtype = _counts(getattr(meta, "size", None)), _dtype_of(getattr(meta, "properties", None))
        if not is_model_key(key):
            tensors[key] = DistTensor(size or (), dtype or "?", ())
            continue
        if size is None or dtype is None or not isinstance(meta.chunks, list):
            raise CheckpointError(f"{md_path}: tensor {key} has no integer shape, dtype or chunk list")
        chunks = []
        for chunk in meta.chunks:
            offs, sizes = _counts(getattr(chunk, "offsets", None)), _counts(getattr(chunk, "sizes", None))
            if offs is None or sizes is None or len(offs) != len(size) or len(sizes) != len(size) or any(
                    o + s > d for o, s, d in zip(offs, sizes, size)):
                raise CheckpointError(f"{md_path}: tensor {key} {size} has a chunk at {offs} of {sizes} outside it")
            info = storage.get((key, offs))
            if info is None:
                raise CheckpointError(f"{md_path}: lists chunk {offs} of {key} but no storage for it")
            file, at, length = (getattr(info, "relative_path", None), getattr(info, "offset", None),
                                getattr(info, "length", None))
            if not plain_file_name(file) or not _count(at) or not _count(length):
                raise CheckpointError(f"{md_path}: chunk {offs} of {key} is stored at {file!r:.80} "
                                      f"({type(at).__name__} offset, {type(length).__name__} length), not at a byte "
                                      f"range of a file in this folder")
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{md_path}: chunk {offs} of {key} is stored transformed "
                                      f"({info.transform_descriptors!r:.60}); not read")
            chunks.append(DistChunk(offs, sizes, file, at, length))
        tensors[key] = DistTensor(size, dtype, tuple(chunks))
    return tensors, objects


def _check_tiling(key: str, t: DistTensor, where: str) -> None:
    """The chunks of ``t`` cover its global shape exactly once (``converters/formats/chunk_tiling``)."""
    check_tiling(key, t.size, t.chunks, lambda message: CheckpointError(f"{where}: {message}"))


def skipped_summary(entries: Mapping[str, Any]) -> dict[str, str]:
    """Non-model entries of a torch_dist ``.metadata`` (name -> entry metadata): {group: 'N tensors, M objects'}."""
    counts: dict[str, list[int]] = {}
    for key, meta in entries.items():
        if is_model_key(key):
            continue
        group = key.split("/", 1)[0].split(".", 1)[0]
        c = counts.setdefault(group, [0, 0])
        c[0 if hasattr(meta, "chunks") else 1] += 1
    out = {}
    for group, (tensors, objects) in sorted(counts.items()):
        parts = ([f"{tensors} tensor{'s' * (tensors != 1)}"] if tensors else []) + \
                ([f"{objects} object{'s' * (objects != 1)}"] if objects else [])
        out[group] = ", ".join(parts)
    return out


def config_without_args(hf_config_dir: str | None, where: str) -> Any:
    """The HF config describing a torch_dist checkpoint that has no Megatron args."""
    if not hf_config_dir:
        raise CheckpointError(f"{where}: no Megatron args in the checkpoint (written by dist_checkpointing.save "
                              f"alone, verl or Megatron-Bridge?): pass --hf-config DIR, the HF model it was "
                              f"trained from")
    return read_hf_config(hf_config_dir)


# ------------------------------------------------------------------------------------------- reading


class DistCheckpoint:
    """A torch_dist checkpoint folder, opened and checked (see the module docstring); ``validate()``
    makes the checks that need the model's weight map and every chunk archive. Fields: ``it_dir``,
    ``tensors`` (key -> DistTensor), ``objects`` (byte-item keys), ``args`` (None without), ``common``,
    ``hf_config``, ``arch``, ``cfg``, ``wmap``, ``padded_vocab``, ``layout`` (args_layout or None),
    ``iteration``, ``dtype`` (tag of the model tensors), ``skipped`` (non-model entries)."""

    format = "megatron-dist"

    def __init__(self, path: str, *, arch: str | None = None, hf_config_dir: str | None = None,
                 vocab_size: int | None = None) -> None:
        self.path = str(path)
        self.it_dir = it_dir = resolve_iteration_dir(Path(path))
        read_backend(it_dir / "metadata.json")
        md_path = it_dir / ".metadata"
        self.tensors, self.objects = parse_metadata(read_pickle(md_path), md_path)
        self._chunks: dict[tuple[str, tuple[int, ...]], RawTensor | StridedTensor] = {}
        self.common: dict = {}
        self.args = self._read_args()
        where = str(it_dir)
        if self.args is None:  # dist_checkpointing.save alone, verl, Megatron-Bridge: an HF config describes it
            config = config_without_args(hf_config_dir, where)
            self.layout: dict[str, Any] | None = None
        else:
            config = hf_config_from_args(self.args, arch=arch, hf_config_dir=hf_config_dir, vocab_size=vocab_size,
                                         where=where)
            self.layout = args_layout(self.args)
        self.hf_config = config
        config_path = f"{hf_config_dir}/config.json" if hf_config_dir else "the config from the Megatron args"
        # sizes (text layers, vision blocks) against the tensors before the weight map lists them
        cfg = architecture_for(getattr(config, "model_type", None), self.path).model_config(config)
        check_config_against_dist(cfg, {k: t.size for k, t in self.tensors.items()}, config_path, where)
        mtp = mtp_layers_of((k for k in self.tensors if is_model_key(k)), where)  # a hybrid's MTP block
        recorded = int(arg_value(self.args, "mtp_num_layers", 0) or 0) if self.args is not None else mtp
        if recorded != mtp:
            raise CheckpointError(f"{where}: the Megatron args say mtp_num_layers={recorded}, the checkpoint holds "
                                  f"{mtp} MTP layer(s) (mtp.layers.*)")
        self.arch, self.cfg, self.wmap = model_from_config(config, self.path, megatron="torch_dist", mtp_layers=mtp)
        self.text_prefix = BRIDGE_TEXT_PREFIX if self.cfg.vision is not None or getattr(self.cfg, "carried", ()) else ""
        self.skipped = skipped_summary({**self.tensors, **{k: None for k in self.objects}})
        emb = self.tensors.get(self.text_prefix + EMBEDDING)
        self.padded_vocab = emb.size[0] if emb is not None and emb.size else self.cfg.vocab_size
        self.dtype = next((t.dtype for k, t in self.tensors.items() if is_model_key(k)), "F32")
        iteration = getattr(self.args, "iteration", None) if self.args is not None else None
        if iteration is None:  # Megatron-Bridge keeps it in common.pt only
            iteration = self.common.get("iteration")
        self.iteration = iteration if _count(iteration) else None

    def _read_args(self) -> Any:
        """Megatron-LM's args from common.pt (or an 'args' item); None when the checkpoint has none."""
        common = self.it_dir / "common.pt"
        if common.exists():
            data = read_torch_archive(common)
            if not isinstance(data, dict):
                raise CheckpointError(f"{common}: holds a {type(data).__name__}, not the dict of common state "
                                      f"megatron-core writes")
            self.common = data
            if data.get("args") is not None:
                check_args(data["args"], str(common))
                return data["args"]
        if "args" in self.objects:  # newer Megatron keeps common state inside the checkpoint
            info = self.objects["args"]
            file, at, length = (getattr(info, "relative_path", None), getattr(info, "offset", None),
                                getattr(info, "length", None))
            if not plain_file_name(file) or not _count(at) or not _count(length):
                raise CheckpointError(f"{self.it_dir / '.metadata'}: the 'args' item has no byte range in a file of "
                                      f"this folder")
            args = read_torch_archive(self.it_dir / file, at, length)
            check_args(args, f"{self.it_dir / file} (the 'args' item)")
            return args
        if COMMON_STATE in self.objects and not self.common:  # megatron-core >= 0.17 (Megatron-Bridge)
            self.common = self._common_state(self.objects[COMMON_STATE])
        return None

    def _common_state(self, info: Any) -> dict:
        """The ``common_state`` item (``torch.save([dict])``: iteration, checkpoint_version, content
        metadata); {} when it is not such a dict (it carries no weights, so it only loses the iteration)."""
        file, at, length = (getattr(info, "relative_path", None), getattr(info, "offset", None),
                            getattr(info, "length", None))
        if not plain_file_name(file) or not _count(at) or not _count(length):
            raise CheckpointError(f"{self.it_dir / '.metadata'}: the {COMMON_STATE} item has no byte range in a file "
                                  f"of this folder")
        try:
            data = read_torch_archive(self.it_dir / file, at, length)
        except CheckpointError:
            return {}
        return data[0] if isinstance(data, list) and len(data) == 1 and isinstance(data[0], dict) else {}

    def chunk(self, key: str, chunk: DistChunk) -> RawTensor | StridedTensor:
        """Where the bytes of one chunk are, its archive read and checked (cached)."""
        found = self._chunks.get((key, chunk.offsets))
        if found is None:
            path = self.it_dir / chunk.file
            if not path.is_file():
                raise CheckpointError(f"{path}: missing data file (chunk {chunk.offsets} of {key})")
            try:
                found = read_torch_archive(path, chunk.offset, chunk.length)
            except CheckpointError as exc:
                raise CheckpointError(f"{self.it_dir}: corrupt chunk {chunk.offsets} of {key} ({exc})") from exc
            if not isinstance(found, (RawTensor, StridedTensor)) or found.shape != chunk.sizes:
                what = (f"a tensor of {found.shape}" if isinstance(found, (RawTensor, StridedTensor))
                        else f"a {type(found).__name__}")
                raise CheckpointError(f"{path}: chunk {chunk.offsets} of {key} holds {what}, .metadata says a "
                                      f"tensor of {chunk.sizes}")
            if found.dtype != self.tensors[key].dtype:
                raise CheckpointError(f"{path}: chunk {chunk.offsets} of {key} holds {found.dtype}, .metadata says "
                                      f"{self.tensors[key].dtype}")
            self._chunks[(key, chunk.offsets)] = found
        return found

    def layer_keys(self, layer: int) -> list[tuple[Any, str, Any]]:
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

    def unit_keys(self, unit: Unit) -> list[tuple[Any, list[tuple[str, int | None]], Any]]:
        """(plain entry, its torch_dist tensors as (key, component rows or None), index) of every stored
        tensor of a unit: ``layer_keys`` (one tensor each), or a Gated DeltaNet hybrid's per-layer keys
        (``layout.hybrid.dist_unit_keys``: ``in_proj`` / ``conv1d`` one tensor per component)."""
        if is_hybrid(self.wmap):
            return dist_unit_keys(self.wmap, unit)
        if unit in (EMBED, FINAL):  # Qwen3-VL's tower blocks and DeepStack mergers stacked (``tower_block``)
            out = []
            for e in self.wmap.first_entries if unit == EMBED else self.wmap.last_entries:
                block = tower_block(e.megatron)
                out.append((e, [(e.megatron, None)], None) if block is None else (e, [(block[0], None)], (block[1],)))
            return out
        return [(e, [(key, None)], idx) for e, key, idx in self.layer_keys(int(unit))]

    def expected(self) -> list[tuple[str, tuple[int, ...]]]:
        """(torch_dist key, global shape) of every tensor a conversion needs."""
        shapes = hf_shapes(self.cfg, self.wmap)
        if is_hybrid(self.wmap):
            out: dict[str, tuple[int, ...]] = {}
            for unit in all_units(self.cfg):
                for entry, keys, idx in self.unit_keys(unit):
                    full = megatron_full_shape(entry, shapes, self.cfg, self.padded_vocab)
                    lead = dist_lead(self.wmap, keys[0][0], idx)
                    out.update((key, (*lead, rows or full[0], *full[1:])) for key, rows in keys)
            return list(out.items())
        L = self.cfg.num_hidden_layers
        out = {}
        for unit in (EMBED, FINAL):
            for entry, ((key, _),), idx in self.unit_keys(unit):
                lead = dist_lead(self.wmap, key, idx)
                out[key] = (*lead, *megatron_full_shape(entry, shapes, self.cfg, self.padded_vocab))
        experts = self.cfg.moe.num_experts if self.cfg.moe is not None else 0
        for i in range(L):
            for entry, key, idx in self.layer_keys(i):
                full = megatron_full_shape(entry, shapes, self.cfg, self.padded_vocab)
                lead = () if idx is None else (L,) if isinstance(idx, int) else (L, experts)[-len(idx):]
                out.setdefault(key, (*lead, *full))
        return list(out.items())

    def validate(self) -> None:
        """Exactly the tensors the model needs with their global shapes (one CheckpointError listing
        the problems), then every model chunk: the tiling, its data file and archive."""
        expected = self.expected()
        problems = []
        for key, shape in expected:
            meta = self.tensors.get(key)
            if meta is None:
                problems.append(f"missing tensor {key}")
            elif meta.size != tuple(shape):
                problems.append(f"tensor {key} has global shape {meta.size}, the config implies {tuple(shape)}")
        names = {k for k, _ in expected}
        tied_copy = {self.text_prefix + OUTPUT} if self.cfg.tie_word_embeddings else set()
        unused = sorted(k for k in self.tensors if k not in names and k not in tied_copy and is_model_key(k))
        if unused:
            problems.append(f"unused tensor(s) {', '.join(unused[:8])} (not part of a {self.arch.name} model)")
        sizes: dict[str, int] = {}
        needs: dict[str, int] = {}  # a truncated data file: the end of its last chunk (named once)
        for key, t in self.tensors.items():
            if not is_model_key(key):
                continue
            for c in t.chunks:
                if c.file not in sizes:
                    path = self.it_dir / c.file
                    sizes[c.file] = path.stat().st_size if path.is_file() else -1
                if sizes[c.file] < 0:
                    problems.append(f"missing data file {c.file}")
                elif sizes[c.file] < c.offset + c.length:
                    needs[c.file] = max(needs.get(c.file, 0), c.offset + c.length)
        problems += [f"truncated data file {f} ({sizes[f]} bytes, needs {n})" for f, n in needs.items()]
        if problems:
            raise CheckpointError(f"{self.it_dir}: " + "; ".join(sorted(set(problems))[:10]))
        for key in sorted(k for k in self.tensors if is_model_key(k)):
            t = self.tensors[key]
            _check_tiling(key, t, str(self.it_dir / ".metadata"))
            for c in t.chunks:
                self.chunk(key, c)


# ------------------------------------------------------------------------------------------- writing


def dist_metadata(tensors: dict, bytes_keys: list, tag: str) -> Any:
    """``torch.distributed.checkpoint.metadata.Metadata`` as pickle-writer nodes, as torch pickles it
    (``converters/torch_path/megatron_dist.write_dist`` pickles the real objects; the copy path
    writes these): ``tensors`` key -> {"size", "chunks": [(offsets, sizes, file, offset, length)]},
    ``bytes_keys`` [(key, file, offset, length)] for the byte items, ``tag`` the dtype."""
    from converters.formats import pickles as pw

    g = pw.Global
    props = pw.NewObj(g(DCP, "TensorProperties"), (
        pw.torch_dtype(tag), pw.Reduce(g("torch.serialization", "_get_layout"), ("torch.strided",)), False,
        pw.Reduce(g(DCP, "_MEM_FORMAT_ENCODING"), (0,)), False))
    state_md: dict[str, Any] = {}
    storage: list[tuple[Any, Any]] = []

    def storage_info(fname: str, off: int, length: int) -> Any:
        return pw.NewObj(g("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                         {"relative_path": fname, "offset": off, "length": length})

    for key, meta in tensors.items():
        chunks = sorted(meta["chunks"], key=lambda c: c[0])
        state_md[key] = pw.NewObj(g(DCP, "TensorStorageMetadata"), {
            "properties": props, "size": pw.torch_size(meta["size"]),
            "chunks": [pw.NewObj(g(DCP, "ChunkStorageMetadata"), {"offsets": pw.torch_size(offs),
                                                                   "sizes": pw.torch_size(sizes)})
                       for offs, sizes, *_ in chunks]})
        for offs, _sizes, fname, off, length in meta["chunks"]:
            index = pw.NewObj(g(DCP, "MetadataIndex"), {"fqn": key, "offset": pw.torch_size(offs), "index": None})
            storage.append((index, storage_info(fname, off, length)))
    for key, fname, off, length in bytes_keys:
        state_md[key] = pw.NewObj(g(DCP, "BytesStorageMetadata"), {})
        storage.append((pw.NewObj(g(DCP, "MetadataIndex"), {"fqn": key, "offset": None, "index": None}),
                        storage_info(fname, off, length)))
    return pw.NewObj(g(DCP, "Metadata"), {
        "state_dict_metadata": dict(sorted(state_md.items())), "planner_data": None,
        "storage_data": pw.Items(tuple(storage)), "storage_meta": None, "version": None})
