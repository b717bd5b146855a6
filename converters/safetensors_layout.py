"""The layout of the HF safetensors files a conversion writes, decided before any byte is written.

Names, shapes, dtypes and byte offsets follow from the config alone, so every output file is laid
out up front (header first, tensors at known offsets) and filled by independent tasks; the bytes
never depend on timing or the number of workers. dtypes are safetensors tags ("F32", "BF16", ...)
and nothing here imports torch: both the torch path (``converters/hf.py``) and the copy path
(``converters/copy_plan.py``) plan with it, so they write identical files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Union

from converters.raw_files import ITEMSIZE

Unit = Union[int, str]


def nbytes(shape: Iterable[int], tag: str) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * ITEMSIZE[tag]


@dataclass
class FilePlan:
    name: str
    tensors: list[tuple[str, tuple[int, ...]]]  # (hf_name, shape) in write order
    units: list[Unit]  # units to read, in order


_HEADER_BASE = 8 + 64  # length prefix, {"__metadata__":{"format":"pt"}}, alignment padding


def _header_entry_bytes(name: str, shape: tuple[int, ...]) -> int:
    """Upper bound of one tensor's entry in the JSON header (offsets counted at 20 digits each)."""
    return len(name) + len(",".join(str(d) for d in shape)) + 80


def plan_shards(units_and_shapes: list[tuple[Unit, list[tuple[str, tuple[int, ...]]]]], tag: str,
                max_shard_bytes: int) -> list[FilePlan]:
    """Assign tensors to files in order, starting a new file when the file (header included) would
    pass ``max_shard_bytes``; a single tensor larger than the limit gets a file of its own."""
    files: list[FilePlan] = []
    current: FilePlan | None = None
    size = 0
    for unit, tensors in units_and_shapes:
        for name, shape in tensors:
            n = nbytes(shape, tag) + _header_entry_bytes(name, shape)
            if current is None or (size + n > max_shard_bytes and current.tensors):
                current = FilePlan("", [], [])
                files.append(current)
                size = _HEADER_BASE
            current.tensors.append((name, shape))
            if not current.units or current.units[-1] != unit:
                current.units.append(unit)
            size += n
    count = len(files)
    for i, f in enumerate(files):
        f.name = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
    return files


def header(plan: FilePlan, tag: str) -> bytes:
    """The file's 8-byte length prefix and JSON header (data starts 8-byte aligned)."""
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in plan.tensors:
        n = nbytes(shape, tag)
        head[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw


def tensor_offsets(plan: FilePlan, tag: str) -> dict[str, int]:
    """Absolute file offset of each planned tensor."""
    offsets, off = {}, len(header(plan, tag))
    for name, shape in plan.tensors:
        offsets[name] = off
        off += nbytes(shape, tag)
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
    size = len(head) + sum(nbytes(shape, tag) for _, shape in plan.tensors)
    with open(Path(directory) / plan.name, "wb") as f:
        f.write(head)
        f.truncate(size)


def write_index(files: list[FilePlan], directory: str, tag: str) -> None:
    """``model.safetensors.index.json`` when there is more than one file."""
    if len(files) == 1:
        return
    total = sum(nbytes(shape, tag) for f in files for _, shape in f.tensors)
    index = {"metadata": {"total_size": total},
             "weight_map": {name: f.name for f in files for name, _ in f.tensors}}
    (Path(directory) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
