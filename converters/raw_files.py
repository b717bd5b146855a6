"""Checkpoint files as byte locations, read without torch: safetensors headers, ``torch.save`` zip
archives (legacy Megatron rank files, torch_dist chunks) and torch_dist ``.metadata``.

A ``RawTensor`` is where a tensor's bytes are: file, offset, dtype, shape (row-major, contiguous).
The copy path (``converters/copy_plan.py``) turns these into ``preadv``/``pwrite`` calls, so a
conversion that changes only layout never loads torch nor pulls the tensors through Python.

Unpickling is restricted as in ``converters/safe_pickle.py``: only an allow-list of harmless
globals resolves to real objects (argparse.Namespace, OrderedDict, ...); tensors become
``RawTensor``; torch's globals become plain markers; anything else is an inert ``Opaque``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

from models.common.errors import CheckpointError

# dtype tag (safetensors spelling) -> bytes per element
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_STORAGE_TAGS = {"DoubleStorage": "F64", "FloatStorage": "F32", "HalfStorage": "F16", "BFloat16Storage": "BF16",
                 "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
                 "ByteStorage": "U8", "BoolStorage": "BOOL"}
_TORCH_DTYPE_TAGS = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                     "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
TAG_TO_TORCH_NAME = {v: k for k, v in _TORCH_DTYPE_TAGS.items()}


@dataclass(frozen=True)
class RawTensor:
    """A contiguous row-major tensor stored at ``offset`` in ``path``."""

    path: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def row_nbytes(self) -> int:
        """Bytes of one index along dim 0 (the element size for a 1-D tensor)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.itemsize

    def rows(self, a: int, b: int) -> "RawTensor":
        """Rows ``[a, b)`` along dim 0 (contiguous bytes)."""
        if not 0 <= a <= b <= self.shape[0]:
            raise ValueError(f"rows {a}:{b} out of range for shape {self.shape}")
        return RawTensor(self.path, self.offset + a * self.row_nbytes, self.dtype, (b - a, *self.shape[1:]))

    def index(self, i: int) -> "RawTensor":
        """``tensor[i]`` (drops dim 0)."""
        return RawTensor(self.path, self.offset + i * self.row_nbytes, self.dtype, tuple(self.shape[1:]))


class NonContiguous:
    """A tensor stored with strides the copy path does not handle (the torch path converts it)."""

    def __init__(self, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.shape, self.stride = shape, stride


class Unsupported(Exception):
    """The copy path cannot handle this checkpoint; the engine uses the torch path instead."""


# --------------------------------------------------------------------------------------- unpickling


class Opaque:
    """Stand-in for a global the checkpoint names but we will not import (an enum, a function...);
    records what it was called with. Shared with ``safe_pickle``'s torch-side unpickler."""

    _qualname = "?"

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.args = args
        return obj

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs) -> "Opaque":
        return type(self)(*args)

    def __setstate__(self, state) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<opaque {self._qualname}{self.args if getattr(self, 'args', ()) else ''}>"


def opaque_class(module: str, name: str) -> type:
    """A subclass of ``Opaque`` standing for ``module.name``."""
    return type(name, (Opaque,), {"_qualname": f"{module}.{name}"})


class TorchDtype(str):
    """A torch dtype named in a pickle (``torch.bfloat16`` -> TorchDtype('BF16'))."""


class Record:
    """Generic record for pickled dataclasses (torch.distributed.checkpoint metadata)."""

    _qualname = "?"

    def __init__(self, *args, **kwargs) -> None:  # enums (memory formats) are rebuilt by calling them
        self.args = args

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots)
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def _key(self) -> tuple:
        return tuple(sorted((k, v) for k, v in self.__dict__.items() if k not in ("index", "args")))

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._key() == other._key()  # type: ignore[attr-defined]


def _rebuild_tensor(storage, storage_offset, size, stride, *_args):
    path, offset, dtype = storage
    size, stride = tuple(size), tuple(stride)
    expected, acc = [], 1
    for d in reversed(size):
        expected.append(acc)
        acc *= d
    if any(d != 1 and s != e for d, s, e in zip(size, stride, reversed(expected))):
        return NonContiguous(size, stride)
    return RawTensor(path, offset + storage_offset * ITEMSIZE[dtype], dtype, size)


def _rebuild_parameter(data, *_args):
    return data


def _torch_size(*args):
    return tuple(args[0]) if args else ()


_ALLOWED: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): argparse.Namespace,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): collections.defaultdict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch", "Size"): _torch_size,
}
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
_records: dict[str, type] = {}


class _Unpickler(pickle.Unpickler):
    def __init__(self, fileobj, storages: dict[str, tuple[str, int, str]] | None = None) -> None:
        super().__init__(fileobj)
        self.storages = storages or {}

    def find_class(self, module: str, name: str) -> Any:
        obj = _ALLOWED.get((module, name))
        if obj is not None:
            return obj
        if module == "torch" and name in _STORAGE_TAGS:
            return _STORAGE_TAGS[name]
        if module == "torch" and name in _TORCH_DTYPE_TAGS:
            return TorchDtype(_TORCH_DTYPE_TAGS[name])
        if module in _DCP_MODULES:
            cls = _records.get(name)
            if cls is None:
                cls = _records[name] = type(name, (Record,), {"_qualname": f"{module}.{name}"})
            return cls
        return opaque_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, tag, key, _location, _numel = pid
        if key not in self.storages:
            raise pickle.UnpicklingError(f"storage {key} missing from the archive")
        path, offset = self.storages[key][:2]
        return path, offset, tag if isinstance(tag, str) else "U8"


class _Window:
    """A read-only file object over bytes ``[base, base+length)`` of a file (a zip inside a .distcp)."""

    def __init__(self, f, base: int, length: int) -> None:
        self.f, self.base, self.length, self.pos = f, base, length, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        self.f.seek(self.base + self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return data

    def seekable(self) -> bool:
        return True


def read_torch_archive(path: str | os.PathLike, base: int = 0, length: int | None = None) -> Any:
    """The object a ``torch.save`` zip archive holds, tensors as ``RawTensor`` locations in ``path``.

    ``base``/``length``: the archive is that byte range of the file (torch_dist chunks).
    """
    path = str(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        length = size - base if length is None else length
        try:
            archive = zipfile.ZipFile(_Window(f, base, length) if base or length != size else f)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: not a torch.save archive or truncated ({exc})") from exc
        storages: dict[str, tuple[str, int, str]] = {}
        pkl_name = None
        for info in archive.infolist():
            parts = info.filename.split("/")
            if len(parts) == 2 and parts[1] == "data.pkl":
                pkl_name = info.filename
            elif len(parts) == 3 and parts[1] == "data":
                if info.compress_type != zipfile.ZIP_STORED:
                    raise Unsupported(f"{path}: compressed storage {info.filename}")
                f.seek(base + info.header_offset)
                head = f.read(30)
                if len(head) < 30 or head[:4] != b"PK\x03\x04":
                    raise CheckpointError(f"{path}: damaged zip entry {info.filename}")
                name_len, extra_len = struct.unpack("<HH", head[26:30])
                data_at = base + info.header_offset + 30 + name_len + extra_len
                if data_at + info.file_size > base + length:
                    raise CheckpointError(f"{path}: truncated: {info.filename} needs bytes up to "
                                          f"{data_at + info.file_size}")
                storages[parts[2]] = (path, data_at, "")
            elif len(parts) == 2 and parts[1] == "byteorder" and archive.read(info).strip() not in (b"little", b""):
                raise Unsupported(f"{path}: big-endian archive")
        if pkl_name is None:
            raise CheckpointError(f"{path}: no data.pkl in the archive (not written by torch.save)")
        import io

        try:
            return _Unpickler(io.BytesIO(archive.read(pkl_name)), storages).load()
        except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, ValueError, TypeError) as exc:
            raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from exc


def read_pickle(path: str | os.PathLike) -> Any:
    """A plain pickle file (torch_dist ``.metadata``) with restricted globals."""
    try:
        with open(path, "rb") as f:
            return _Unpickler(f).load()
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: missing") from exc
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: corrupt ({type(exc).__name__}: {exc})") from exc


def read_safetensors(path: str | os.PathLike) -> dict[str, RawTensor]:
    """Name -> RawTensor for every tensor of a safetensors file (header only)."""
    path = str(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
            n = int.from_bytes(raw, "little")
            if n > min(size - 8, 100 << 20):
                raise CheckpointError(f"{path}: corrupt safetensors header length {n} (file has {size} bytes)")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from exc
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        t = RawTensor(path, 8 + n + begin, meta["dtype"], tuple(meta["shape"]))
        if meta["dtype"] not in ITEMSIZE or end - begin != t.nbytes or 8 + n + end > size:
            raise CheckpointError(f"{path}: tensor {name} has inconsistent offsets {begin}..{end} for "
                                  f"{meta['dtype']} {tuple(meta['shape'])} (file has {size} bytes)")
        out[name] = t
    return out
