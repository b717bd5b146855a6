"""The files of an HF model directory, read without torch: config.json, the tokenizer and
generation files (copied as they are), and the safetensors files with their index, validated once
(``SafetensorsFiles``): the model loader and both conversion paths take their tensors from here, experts
stored fused as per-expert byte ranges (``per_expert_views``)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from models.common.errors import CheckpointError

COMPANION_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".py", ".jinja")
NOT_COMPANIONS = {"config.json", "model.safetensors.index.json"}


def copy_companion_files(source: str | os.PathLike, directory: str | os.PathLike) -> None:
    """Copy the tokenizer/generation/chat-template files of HF directory ``source`` into ``directory``
    (not config.json or safetensors indexes: writers produce their own)."""
    import shutil

    for item in sorted(Path(source).iterdir()):
        if (item.is_file() and item.suffix in COMPANION_SUFFIXES and item.name not in NOT_COMPANIONS
                and not item.name.endswith(".safetensors.index.json")):
            shutil.copyfile(item, Path(directory) / item.name)  # the bytes; the mode from the umask


def process_umask() -> int:
    """This process's umask: Linux's ``/proc/self/status`` (read-only, safe beside other threads),
    else ``os.umask`` set and put back."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: Mapping[str, Any], path: str | os.PathLike, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file`` with the mode every other output file gets, ``0666 & ~umask``:
    safetensors 0.8 writes through a private temp file and leaves 0600, which an inference engine
    running as another user cannot read."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~process_umask())


def read_config_json(directory: str | os.PathLike) -> dict:
    """The config.json dict of an HF directory, checked to be a transformers config (CheckpointError
    naming the file otherwise)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{Path(directory)}: no config.json (is this a HuggingFace model directory?)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise CheckpointError(f"{path}: no 'model_type' (not a transformers config)")
    return data


# ------------------------------------------------------------------------------------ safetensors files

# Bytes per element of each safetensors dtype tag (the format's own list).
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses longer headers
MAX_INDEX_BYTES = 100_000_000  # an index is a few MB for the largest models; never read more
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are: ``path`` (a file of the directory, as opened), the absolute byte
    ``offset`` in it, its safetensors ``dtype`` tag, ``shape`` and ``nbytes`` (row-major, contiguous).

    ``stride`` (elements; None: contiguous row-major) marks a view that is not one byte range: element
    ``[i, j]`` at ``offset + (i * stride[0] + j * stride[1]) * itemsize`` (a transposed expert of a release
    checkpoint, ``per_expert_views``). ``nbytes`` is then the view's own bytes (made contiguous), ``span`` the
    bytes it reaches from ``offset``; only readers that map the file read it (the copy path leaves it to the
    torch path)."""

    path: str
    offset: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    stride: tuple[int, ...] | None = None

    @property
    def span(self) -> int:
        """Bytes from ``offset`` to the end of the view's last element."""
        if self.stride is None or not all(self.shape):
            return self.nbytes
        return (sum((n - 1) * s for n, s in zip(self.shape, self.stride)) + 1) * DTYPE_BYTES[self.dtype]


def _no_duplicate_keys(pairs: list) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_safetensors_header(path: str | os.PathLike) -> dict[str, StoredTensor]:
    """Every tensor of a safetensors file (name -> where its bytes are), from the header alone,
    checked as the safetensors library checks a file before it reads one: the 8-byte length and a
    header inside the file (at most ``MAX_HEADER_BYTES``), a UTF-8 JSON object without duplicate
    keys, ``__metadata__`` (if any) mapping strings to strings, every entry with a known ``dtype``,
    a ``shape`` of non-negative integers and ``data_offsets`` [begin, end] whose length is shape x
    dtype; the tensors, in offset order, start at 0 and follow each other without gap or overlap up
    to the end of the file. CheckpointError naming the file (and the tensor) otherwise.

    This is the one reader of safetensors headers: the model loader (``SafetensorsSource``), the
    converters' torch path and their copy path (which moves these byte ranges without looking at
    them, so a file the library would refuse must not get past here) all take their tensors from it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes; the header length alone "
                                      f"takes 8)")
            n = int.from_bytes(raw, "little")
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: corrupt safetensors header: length {n} is over the format's limit "
                                      f"of {MAX_HEADER_BYTES} bytes")
            if 8 + n > size:
                raise CheckpointError(f"{path}: truncated or corrupt safetensors file: header length {n}, the file "
                                      f"has {size} bytes")
            text = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header (not UTF-8 JSON: {exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f"{path}: corrupt safetensors header: '__metadata__' must map strings to strings")
    spans = []
    for name, info in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: its header entry is a JSON {type(info).__name__}, not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{where}: unknown dtype {dtype!r} (safetensors knows {', '.join(DTYPE_BYTES)})")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise CheckpointError(f"{where}: data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
        numel = 1
        for d in shape:
            numel *= d
        begin, end = offsets
        if end - begin != numel * DTYPE_BYTES[dtype]:
            raise CheckpointError(f"{where}: {dtype} {tuple(shape)} takes {numel * DTYPE_BYTES[dtype]} bytes, but "
                                  f"data_offsets [{begin}, {end}] hold {end - begin}")
        spans.append((begin, end, name, dtype, tuple(shape)))
    spans.sort(key=lambda s: (s[0], s[1]))
    data = size - 8 - n
    out: dict[str, StoredTensor] = {}
    at, previous = 0, None
    for begin, end, name, dtype, shape in spans:
        if begin < at:
            raise CheckpointError(f"{path}: tensor {name!r} (data_offsets [{begin}, {end}]) overlaps tensor "
                                  f"{previous[2]!r} ([{previous[0]}, {previous[1]}])")
        if begin > at:
            raise CheckpointError(f"{path}: {begin - at} bytes before tensor {name!r} (data_offsets [{begin}, {end}]) "
                                  f"belong to no tensor")
        out[name] = StoredTensor(str(path), 8 + n + begin, dtype, shape, end - begin)
        at, previous = end, (begin, end, name)
    if at > data:
        raise CheckpointError(f"{path}: truncated: the tensors need {8 + n + at} bytes, the file has {size}")
    if at < data:
        raise CheckpointError(f"{path}: {data - at} bytes after the last tensor belong to no tensor")
    return out


def plain_file_name(name: Any) -> bool:
    """``name`` names a file directly inside a directory: no separator, not '.' or '..', not empty."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def read_bounded(path: str | os.PathLike, limit: int, expected: str) -> bytes:
    """The bytes of a small metadata file (index, tracker, metadata.json, run_config.yaml), read
    without trusting its size: CheckpointError naming the file when it cannot be read or holds more
    than ``limit`` bytes (``expected``: what such a file should be, for the message)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if len(raw) > limit:
        raise CheckpointError(f"{path}: over {limit} bytes ({expected})")
    return raw


def _read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a ``model.safetensors.index.json``: tensor name -> a plain file name."""
    raw = read_bounded(index, MAX_INDEX_BYTES, "not a safetensors index")
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{index}: not a valid JSON index ({exc})") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        found = f"a JSON {type(data).__name__}" if not isinstance(data, dict) else "no 'weight_map' object"
        raise CheckpointError(f"{index}: {found}; an index maps tensor names to files under 'weight_map'")
    for name, fname in weight_map.items():
        if not plain_file_name(fname):
            raise CheckpointError(f"{index}: entry {name!r} names {fname!r}, not a file name in this directory")
    return weight_map


class SafetensorsFiles:
    """The tensors of an HF model directory, validated once, as byte ranges (``StoredTensor``).

    Files: ``model.safetensors.index.json`` and exactly the files its ``weight_map`` names (plain
    file names inside the directory; each must exist), else ``model.safetensors``. Every header is
    checked (``read_safetensors_header``), every tensor lives in exactly one file, and index and
    files agree both ways: the file an entry names holds that tensor, and every tensor of a named
    file is listed. Other ``*.safetensors`` files beside them (adapters, leftovers) are not read,
    as transformers does not read them. CheckpointError naming the file and the tensor or entry."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_NAME
        weight_map: dict[str, str] | None = None
        if index.is_file():
            self.index: Path | None = index
            weight_map = _read_index(index)
            self.files = sorted(set(weight_map.values()))
            for name, fname in weight_map.items():
                if not (self.directory / fname).is_file():
                    raise CheckpointError(f"{index}: entry {name!r} names {fname}, which is not a file in "
                                          f"{self.directory}")
        elif (self.directory / SINGLE_NAME).is_file():
            self.index, self.files = None, [SINGLE_NAME]
        else:
            found = sorted(p.name for p in self.directory.iterdir()) if self.directory.is_dir() else "no such directory"
            raise CheckpointError(f"{self.directory}: no {SINGLE_NAME} or {INDEX_NAME} (found: {found})")
        self.tensors: dict[str, StoredTensor] = {}
        self._file_of: dict[str, str] = {}
        for fname in self.files:
            for name, stored in read_safetensors_header(self.directory / fname).items():
                if name in self._file_of:  # which copy is meant is anyone's guess: refuse, naming both files
                    listed = f" (the index lists {weight_map[name]})" if weight_map and name in weight_map else ""
                    raise CheckpointError(f"{self.directory}: tensor {name!r} is stored twice, in "
                                          f"{self._file_of[name]} and in {fname}{listed}")
                self._file_of[name], self.tensors[name] = fname, stored
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self._file_of:
                    raise CheckpointError(f"{index}: entry {name!r} names {fname}, which does not hold that tensor")
                if self._file_of[name] != fname:
                    raise CheckpointError(f"{index}: entry {name!r} names {fname}, but the tensor is in "
                                          f"{self._file_of[name]}")
            for name, fname in self._file_of.items():
                if name not in weight_map:
                    raise CheckpointError(f"{index}: no entry for tensor {name!r}, which {fname} holds")

    def names(self) -> set[str]:
        return set(self.tensors)

    def file_of(self, name: str) -> str:
        """The file (name within the directory) that holds tensor ``name``."""
        return self._file_of[name]


def canonical_names(names: Iterable[str], rename: Callable[[str], str], where: str) -> dict[str, str]:
    """Stored tensor names under the weight map's names (``rename``: another key layout of the same
    model, e.g. transformers' in-memory ``model.language_model.*`` for the on-disk ``model.*``):
    canonical name -> stored name. Two stored names for one weight is a CheckpointError."""
    original: dict[str, str] = {}
    for name in sorted(names):
        new = rename(name)
        if new in original:
            raise CheckpointError(f"{where}: tensors {original[new]} and {name} are the same weight ({new}) in two "
                                  f"key layouts")
        original[new] = name
    return original


def check_tensors(shapes: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]], where: str,
                  allowed_extra: Iterable[str] = (), files: Mapping[str, str] | None = None) -> None:
    """Every expected tensor present with its shape, nothing unexplained left over (names ending in
    one of the weight map's ``IGNORED_SUFFIXES`` excepted); else one CheckpointError listing the
    problems (a mis-shaped tensor with the file holding it, when ``files`` maps names to files). The
    model loader (``validate_source``) and the converters' HF reader both use it."""
    from models.common.weight_map import IGNORED_SUFFIXES

    missing = sorted(set(expected) - set(shapes))
    wrong = sorted(f"{n} {tuple(shapes[n])} (expected {tuple(expected[n])})" + (f" in {files[n]}" if files else "")
                   for n in set(expected) & set(shapes) if tuple(shapes[n]) != tuple(expected[n]))
    extra = sorted(n for n in set(shapes) - set(expected) - set(allowed_extra) if not n.endswith(IGNORED_SUFFIXES))
    problems = []
    if missing:
        more = " ..." if len(missing) > 8 else ""
        problems.append(f"{len(missing)} missing tensor(s): {', '.join(missing[:8])}{more}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) with the wrong shape: {'; '.join(wrong[:8])}")
    if extra:
        problems.append(f"{len(extra)} unexpected tensor(s): {', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}")
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))


FUSED_GATE_UP, FUSED_DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"


def per_expert_views(path: str, stored_as: dict[str, str], tensors: dict[str, StoredTensor],
                     cfg: Any, transposed: bool = False) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """The checkpoint's tensors under the weight map's per-expert names: experts stored fused
    (``mlp.experts.gate_up_proj [E, 2F, H]``, gate rows then up rows per expert, and ``down_proj [E, H, F]``,
    as transformers holds them in memory and Qwen3.5-MoE / Qwen3.6 releases store them) become one view per
    expert (``mlp.experts.{e}.gate_proj.weight`` ...): each is a contiguous byte range of the fused tensor,
    so both conversion paths read it as any stored tensor and the model loader (``weights.checkpoint_source``)
    maps only the experts a rank loads: the one rule for fused experts. Others pass through (``stored_as``:
    weight-map name -> stored name). Returns (name -> where its bytes are, name -> the stored tensor it is in).

    ``transposed`` (a weight map with ``fused_experts``: Qwen3-VL-MoE): the original Qwen3-VL-MoE releases store
    the same tensors transposed (``gate_up_proj [E, H, 2F]``: per expert ``x @ W`` with gate columns then up
    columns; ``down_proj [E, F, H]``), which transformers 5.24 transposes on load for that model alone
    (``conversion_mapping``'s ``Transpose(1, 2, check_dims=True)``; other MoE models refuse them): each view is then
    strided (``StoredTensor.stride``: expert e's gate is columns ``[0, F)`` of its ``[H, 2F]`` block, read
    transposed), so a reader still touches one expert at a time. Which layout a tensor is in is decided as
    transformers decides it, tensor by tensor: the shape transformers holds (``[E, 2F, H]`` / ``[E, H, F]``)
    is read as it is, any other shape is transposed. When ``hidden_size == 2 * moe_intermediate_size`` (gate_up)
    or ``hidden_size == moe_intermediate_size`` (down) both layouts have the same shape and the tensor is read
    untransposed, as transformers reads it (a release checkpoint of such a shape would be misread by both).
    CheckpointError for a fused tensor of another shape, or a layer holding both forms."""
    out: dict[str, StoredTensor] = {}
    origin: dict[str, str] = {}
    moe = getattr(cfg, "moe", None)
    for name, stored in stored_as.items():
        t = tensors[stored]
        if moe is None or not name.endswith((FUSED_GATE_UP, FUSED_DOWN)):
            out[name], origin[name] = t, stored
            continue
        prefix, gate_up = name.rsplit(".", 1)[0] + ".", name.endswith(FUSED_GATE_UP)
        E, H, F = moe.num_experts, cfg.hidden_size, moe.moe_intermediate_size  # every sparse layer's width
        rows = 2 * F if gate_up else H  # rows of one expert's block as transformers holds it
        cols = H if gate_up else F
        flip = tuple(t.shape) != (E, rows, cols)  # transformers' own shape first: read as it is
        if flip and not (transposed and tuple(t.shape) == (E, cols, rows)):
            what = "E, 2 * moe_intermediate_size, hidden_size" if gate_up else "E, hidden_size, moe_intermediate_size"
            release = f" or, as the original releases store them, {(E, cols, rows)}" if transposed else ""
            raise CheckpointError(f"{path}: fused experts {name} have shape {tuple(t.shape)}, the config implies "
                                  f"{(E, rows, cols)} ({what}){release}")
        each, item = t.nbytes // E, DTYPE_BYTES[t.dtype]
        parts = (("gate_proj", 0), ("up_proj", F)) if gate_up else (("down_proj", 0),)
        shape = (F, H) if gate_up else (H, F)
        for e in range(E):
            for part, first_row in parts:
                view = f"{prefix}{e}.{part}.weight"
                if view in stored_as:
                    raise CheckpointError(f"{path}: {prefix} holds its experts twice, fused ({name}) and per expert "
                                          f"({view})")
                nbytes = shape[0] * shape[1] * item
                if flip:  # rows [first_row, ...) of the block = columns of the stored [cols, rows] block
                    out[view] = StoredTensor(t.path, t.offset + e * each + first_row * item, t.dtype, shape, nbytes,
                                             stride=(1, rows))
                else:
                    out[view] = StoredTensor(t.path, t.offset + e * each + first_row * cols * item, t.dtype, shape,
                                             nbytes)
                origin[view] = stored
    return out, origin


_EXPERT_NAME = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def fused_expert_layout(tensors: Sequence[tuple[str, Sequence[int]]]
                        ) -> tuple[list[tuple[str, tuple[int, ...]]], dict[str, tuple[str, int]]]:
    """The writers' side of ``per_expert_views`` (its inverse, the same rule): per-expert tensors
    ``(name, shape)`` in the weight map's order stored fused as transformers 5.24 saves Qwen3-VL-MoE
    (``WeightMap.fused_experts``): each layer's ``mlp.experts.{e}.gate_proj`` / ``up_proj`` become one
    ``mlp.experts.gate_up_proj [E, 2F, H]`` (expert e's gate rows then its up rows) and ``down_proj`` one
    ``mlp.experts.down_proj [E, H, F]``, placed where the layer's first expert tensor was; other tensors as they
    are. Every per-expert tensor is a contiguous range of its fused tensor, so writers fill the fused tensor
    expert by expert without holding the layer's experts twice.

    Returns (the stored tensors ``(name, shape)`` in order, per-expert name -> (stored name, element offset));
    a layer's experts must be complete (0..E-1, gate and up together): AssertionError otherwise (the weight
    map always lists them so)."""
    groups: dict[str, list[tuple[int, str, tuple[int, ...]]]] = {}
    stored: list[tuple[str, tuple[int, ...]]] = []
    for name, shape in tensors:
        m = _EXPERT_NAME.fullmatch(name)
        if m is None:
            stored.append((name, tuple(shape)))
            continue
        fused = m.group(1)[:-1] + (".down_proj" if m.group(3) == "down_proj" else ".gate_up_proj")
        if fused not in groups:
            groups[fused] = []
            stored.append((fused, ()))  # shape once the group is complete
        groups[fused].append((int(m.group(2)), name, tuple(shape)))
    where: dict[str, tuple[str, int]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for fused, members in groups.items():
        experts = sorted({e for e, _, _ in members})
        per = len(members) // len(experts)
        assert experts == list(range(len(experts))) and len(members) == per * len(experts), fused
        rows, cols = members[0][2]
        for e, name, shape in members:
            assert shape == (rows, cols), (name, shape)
            part = 1 if name.endswith(".up_proj.weight") else 0  # gate (or down) rows first, then up
            where[name] = (fused, (e * per + part) * rows * cols)
        shapes[fused] = (len(experts), per * rows, cols)
    return [(n, shapes.get(n, s)) for n, s in stored], where
