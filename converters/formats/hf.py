"""HuggingFace model directories: the validating reader (``HFCheckpoint``) and the layout of the
safetensors files a conversion writes, side by side.

Reading: config.json as data, the safetensors files and index through ``models/common/hf_files``
(the one safetensors reader, shared with the model loader), the tensors' names in the weight map's
key layout, config sizes against the tensors present (before anything sized by the config is
built), and exactly the tensors the model needs with their shapes. Both conversion paths open
this and nothing else: the copy path copies its byte ranges, the torch path reads its tensors.

Writing: names, shapes, dtypes and byte offsets follow from the config alone, so every output file
is laid out up front (header first, tensors at known offsets) and filled by independent tasks; the
bytes never depend on timing or the number of workers. dtypes are safetensors tags ("F32", "BF16",
...) and nothing here imports torch: both the torch path (``converters/torch_path/hf.py``) and the
copy path (``converters/copy_path/hf.py``) plan with it, so they write identical files.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence, Union

from converters.formats.hf_config import check_block_count, check_config_against_tensors, read_hf_config
from converters.formats.quantized import check_unquantized_tensors
from converters.formats.tensors import ITEMSIZE
from converters.layout.model import architecture_for, checkpoint_weight_map
from models.common.hf_files import (  # noqa: F401 (per_expert_views: the rule the model loader reads too)
    SafetensorsFiles,
    StoredTensor,
    canonical_names,
    check_tensors,
    fused_expert_layout,
    per_expert_views,
)
from models.common.weight_map import hf_shapes

# ------------------------------------------------------------------------------------------- reading


class HFCheckpoint:
    """An HF model directory, validated once for conversion (CheckpointError naming the file and the
    tensor or entry otherwise): ``hf_config``, ``arch``, ``cfg``, ``wmap``, ``files`` (the validated
    ``SafetensorsFiles``) and ``tensors``: the weight map's name -> where its bytes are."""

    format = "hf"

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self.hf_config = read_hf_config(path)
        self.files = SafetensorsFiles(path)
        # FP8 tensors named before the weight map reads the names (else: "unexpected *_scale_inv")
        check_unquantized_tensors(self.path, ((name, t.dtype) for name, t in self.files.tensors.items()),
                                  lambda name: Path(path) / self.files.file_of(name))
        arch = architecture_for(self.hf_config.model_type, self.path)
        cfg = arch.model_config(self.hf_config)
        # other key layouts of the same model (Qwen2-VL's in-memory names) under the weight map's names
        stored_as = canonical_names(self.files.names(), arch.canonical_name, self.path)
        config_path = Path(path) / "config.json"
        # counted blocks (layers, vision blocks) against the stored names before any weight map lists them one
        # by one (an absurd depth in config.json must not build a table of that size)
        present = {name: self.files.tensors[stored].shape for name, stored in stored_as.items()}
        for field, count, prefix in arch.counted_blocks(cfg) if arch.counted_blocks else ():
            check_block_count(config_path, field, count, prefix, present)
        # experts stored fused: one view per expert (byte ranges of the fused tensors; strided views of a release's
        # transposed ones where the model's map says HF stores them fused, as transformers reads them)
        fused = arch.weight_map(cfg, cfg.vocab_size).fused_experts
        views, origin = per_expert_views(self.path, stored_as, self.files.tensors, cfg, fused)
        shapes = {name: t.shape for name, t in views.items()}
        files = {name: self.files.file_of(stored) for name, stored in origin.items()}
        wmap = checkpoint_weight_map(arch, cfg, shapes, self.path)  # a hybrid's MTP block when it has one
        check_config_against_tensors(config_path, cfg, wmap, shapes, files)
        allowed = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
        check_tensors(shapes, hf_shapes(cfg, wmap), self.path, allowed_extra=allowed, files=files)
        self.arch, self.cfg, self.wmap = arch, cfg, wmap
        self.tensors: dict[str, StoredTensor] = views
        # weight-map names that are views into a fused tensor, not stored under their own name
        self.views = {name for name in views if name not in stored_as}


# ------------------------------------------------------------------------------------------- writing

Unit = Union[int, str]


def nbytes(shape: Iterable[int], tag: str) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * ITEMSIZE[tag]


@dataclass
class FilePlan:
    """One output file: the weight map's HF tensors it holds (``tensors``, what readers produce and writers
    fill, in write order) and the units to read for them. ``stored``: the tensors of its header when they
    differ (a ``fused_experts`` map: each layer's experts as one fused tensor, ``hf_files.fused_expert_layout``),
    ``within``: per-expert name -> (its fused tensor, element offset there); ``tensor_offsets`` places each
    per-expert tensor inside its fused one, so writers need not know."""

    name: str
    tensors: list[tuple[str, tuple[int, ...]]]  # (hf_name, shape) in write order
    units: list[Unit]  # units to read, in order
    stored: list[tuple[str, tuple[int, ...]]] | None = None
    within: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)

    def on_disk(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of the tensors the file's header lists, in order."""
        return self.tensors if self.stored is None else self.stored


_HEADER_BASE = 8 + 64  # length prefix, {"__metadata__":{"format":"pt"}}, alignment padding


def _header_entry_bytes(name: str, shape: tuple[int, ...]) -> int:
    """Upper bound of one tensor's entry in the JSON header (offsets counted at 20 digits each)."""
    return len(name) + len(",".join(str(d) for d in shape)) + 80


def plan_shards(units_and_shapes: list[tuple[Unit, list[tuple[str, tuple[int, ...]]]]], tag: str,
                max_shard_bytes: int, fused_experts: bool = False) -> list[FilePlan]:
    """Assign tensors to files in order, starting a new file when the file (header included) would
    pass ``max_shard_bytes``; a single tensor larger than the limit gets a file of its own.
    ``fused_experts`` (the weight map's flag): each layer's experts stored as its fused tensors
    (``hf_files.fused_expert_layout``), each fused tensor whole in one file."""
    files: list[FilePlan] = []
    current: FilePlan | None = None
    size = 0
    for unit, tensors in units_and_shapes:
        stored, within = fused_expert_layout(tensors) if fused_experts else (tensors, {})
        members: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for name, shape in tensors:
            members.setdefault(within[name][0] if name in within else name, []).append((name, tuple(shape)))
        for name, shape in stored:
            n = nbytes(shape, tag) + _header_entry_bytes(name, shape)
            if current is None or (size + n > max_shard_bytes and current.tensors):
                current = FilePlan("", [], [], [] if fused_experts else None)
                files.append(current)
                size = _HEADER_BASE
            current.tensors.extend(members[name])
            if current.stored is not None:
                current.stored.append((name, tuple(shape)))
                current.within.update((m, within[m]) for m, _ in members[name] if m in within)
            if not current.units or current.units[-1] != unit:
                current.units.append(unit)
            size += n
    count = len(files)
    for i, f in enumerate(files):
        f.name = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
    return files


def stored_header(stored: Iterable[tuple[str, Sequence[int], str]]) -> bytes:
    """The 8-byte length prefix and JSON header (data starts 8-byte aligned) of a file holding
    ``(name, shape, dtype tag)`` tensors in that order, each with its own dtype."""
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, tag in stored:
        n = nbytes(shape, tag)
        head[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw


def stored_offsets(stored: Sequence[tuple[str, Sequence[int], str]]) -> dict[str, int]:
    """Absolute file offset of each ``(name, shape, dtype tag)`` tensor of ``stored_header``'s file."""
    offsets, off = {}, len(stored_header(stored))
    for name, shape, tag in stored:
        offsets[name] = off
        off += nbytes(shape, tag)
    return offsets


def header(plan: FilePlan, tag: str) -> bytes:
    """The planned file's header, every tensor in dtype ``tag``."""
    return stored_header([(name, shape, tag) for name, shape in plan.on_disk()])


def tensor_offsets(plan: FilePlan, tag: str) -> dict[str, int]:
    """Absolute file offset of each planned tensor (``plan.tensors``; a per-expert tensor inside its fused
    one), every tensor in dtype ``tag``."""
    offsets = stored_offsets([(name, shape, tag) for name, shape in plan.on_disk()])
    for name, (fused, at) in plan.within.items():
        offsets[name] = offsets[fused] + at * ITEMSIZE[tag]
    return offsets


def split_file_plan(plan: FilePlan, parts: int) -> list[tuple[int, int]]:
    """Contiguous tensor-index ranges of a planned file with about equal bytes (for parallel writers)."""
    sizes = [nbytes(shape, "U8") for _, shape in plan.tensors]
    total = sum(sizes)
    ranges, start, acc = [], 0, 0
    for i, n in enumerate(sizes):
        acc += n
        if len(ranges) < parts - 1 and acc >= total * (len(ranges) + 1) / parts and i + 1 < len(sizes):
            ranges.append((start, i + 1))
            start = i + 1
    ranges.append((start, len(sizes)))
    return ranges


def create_shard_file(plan: FilePlan, directory: str, tag: str) -> None:
    """The file with its header, sized to its final length (tensor bytes are written by tasks)."""
    head = header(plan, tag)
    size = len(head) + sum(nbytes(shape, tag) for _, shape in plan.on_disk())
    with open(Path(directory) / plan.name, "wb") as f:
        f.write(head)
        f.truncate(size)


def write_index(files: list[FilePlan], directory: str, tag: str) -> None:
    """``model.safetensors.index.json`` when there is more than one file."""
    if len(files) == 1:
        return
    total = sum(nbytes(shape, tag) for f in files for _, shape in f.on_disk())
    index = {"metadata": {"total_size": total},
             "weight_map": {name: f.name for f in files for name, _ in f.on_disk()}}
    (Path(directory) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
