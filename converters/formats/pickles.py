"""Pickles of torch objects, read and written without torch: a restricted reader and a small writer.

Reading (``Unpickler``, ``read_pickle``): a checkpoint never imports or runs code from its pickles.
Megatron's rank files pickle an ``argparse.Namespace`` of training arguments (which may reference
Megatron enums, functions or classes) and torch_dist's ``.metadata`` pickles
``torch.distributed.checkpoint`` dataclasses. Only an allow-list of harmless globals resolves to
the real object (argparse.Namespace, OrderedDict, ...); tensors become byte locations checked
against their storage (``RawTensor``, ``StridedTensor``: ``converters/formats/torch_zip`` supplies
the storages); torch dtypes and storage types become plain tags; the checkpoint metadata classes
become plain ``Record``s; anything else is an inert ``Opaque`` placeholder that records its name and
arguments and does nothing, so the weights and plain-valued args still come through.

Writing (``dumps``): the copy path writes Megatron checkpoints (``torch.save`` archives, torch_dist
``.metadata``) without importing torch, so the pickles that name torch classes cannot come from
``pickle.dumps`` of real objects. Instead the structure is described with four node types and
emitted as the opcodes ``pickle`` itself would use for the real objects:

  Global(module, name)         a class or function by name (``torch FloatStorage``, ``torch float32``)
  Reduce(func, args)           ``func(*args)`` at load time (``torch.Size((2, 3))``, tensors)
  NewObj(cls, state)           ``cls.__new__(cls)`` then ``__setstate__``/``__dict__`` update with
                               ``state`` (dataclasses, ``argparse.Namespace``)
  PersistentId(value)          a reference the loader resolves (``torch.save``'s storages)
  Items(pairs)                 a dict whose keys are nodes

plus None, bools, ints, floats, str, bytes, tuples, lists and dicts. Nothing is memoized: the
objects written here share no references, and every unpickler accepts a memo-less stream.
``tests/test_copy_targets.py`` checks the results against the real objects.
"""

from __future__ import annotations

import argparse
import collections
import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from converters.formats.tensors import ITEMSIZE, RawTensor, StridedTensor
from models.common.errors import CheckpointError

# ------------------------------------------------------------------------------------------- reading

_STORAGE_TAGS = {"DoubleStorage": "F64", "FloatStorage": "F32", "HalfStorage": "F16", "BFloat16Storage": "BF16",
                 "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
                 "ByteStorage": "U8", "BoolStorage": "BOOL"}
_TORCH_DTYPE_TAGS = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                     "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


class Opaque:
    """Stand-in for a global the checkpoint names but we will not import (an enum, a function...);
    records what it was called with."""

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


class StorageType(str):
    """A torch storage class named in a pickle (``torch.FloatStorage`` -> StorageType('F32'))."""


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
        return tuple(sorted((k, repr(v)) for k, v in self.__dict__.items() if k not in ("index", "args")))

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._key() == other._key()  # type: ignore[attr-defined]


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _rebuild_tensor(storage, storage_offset, size, stride, *_args):
    """A tensor of a ``torch.save`` archive as the location of its bytes, checked to lie inside its
    storage: a ``RawTensor`` when row-major contiguous, else a ``StridedTensor``."""
    if not (isinstance(storage, tuple) and len(storage) == 4):
        raise pickle.UnpicklingError(f"a tensor without a storage of this archive ({storage!r})")
    path, at, tag, storage_numel = storage
    if not (_count(storage_offset) and isinstance(size, tuple) and isinstance(stride, tuple)
            and len(size) == len(stride) and all(map(_count, size)) and all(map(_count, stride))):
        raise pickle.UnpicklingError(f"a tensor with offset {storage_offset!r}, size {size!r}, stride {stride!r}")
    numel, expected, acc = 1, [], 1
    for d in size:
        numel *= d
    for d in reversed(size):
        expected.append(acc)
        acc *= d
    last = storage_offset + sum((d - 1) * s for d, s in zip(size, stride)) if numel else storage_offset - 1
    if last >= storage_numel:
        raise pickle.UnpicklingError(f"a tensor of size {size} (stride {stride}, offset {storage_offset}) reaches "
                                     f"element {last} of a storage of {storage_numel}")
    if all(d == 1 or s == e for d, s, e in zip(size, stride, reversed(expected))):
        return RawTensor(path, at + storage_offset * ITEMSIZE[tag], tag, size)
    return StridedTensor(path, at, storage_numel, tag, size, stride, storage_offset)


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


class Unpickler(pickle.Unpickler):
    """The restricted unpickler; ``storages``: key -> (path, byte offset, bytes) of a ``torch.save``
    archive's storages (``torch_zip.read_torch_archive``), whose persistent ids it resolves."""

    def __init__(self, fileobj, storages: dict[str, tuple[str, int, int]] | None = None) -> None:
        super().__init__(fileobj)
        self.storages = storages or {}

    def find_class(self, module: str, name: str) -> Any:
        obj = _ALLOWED.get((module, name))
        if obj is not None:
            return obj
        if module == "torch" and name in _STORAGE_TAGS:
            return StorageType(_STORAGE_TAGS[name])
        if module == "torch" and name in _TORCH_DTYPE_TAGS:
            return TorchDtype(_TORCH_DTYPE_TAGS[name])
        if module in _DCP_MODULES:
            cls = _records.get(name)
            if cls is None:
                cls = _records[name] = type(name, (Record,), {"_qualname": f"{module}.{name}"})
            return cls
        return opaque_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, tag, key, _location, numel = pid
        if not isinstance(tag, StorageType):
            raise pickle.UnpicklingError(f"storage {key!r} of type {tag!r} (not a storage type read here)")
        if key not in self.storages:
            raise pickle.UnpicklingError(f"storage {key!r} missing from the archive")
        path, offset, nbytes = self.storages[key]
        if not _count(numel) or numel * ITEMSIZE[tag] != nbytes:
            raise pickle.UnpicklingError(f"storage {key!r} holds {nbytes} bytes, not {numel!r} {tag} elements")
        return path, offset, str(tag), numel


def read_pickle(path: str | os.PathLike) -> Any:
    """A plain pickle file (torch_dist ``.metadata``) with restricted globals."""
    try:
        with open(path, "rb") as f:
            return Unpickler(f).load()
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: missing") from exc
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RecursionError, MemoryError, OverflowError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt ({type(exc).__name__}: {exc})") from exc


# ------------------------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class Global:
    module: str
    name: str


@dataclass(frozen=True)
class Reduce:
    func: Global
    args: tuple


@dataclass(frozen=True)
class NewObj:
    cls: Global
    state: Any


@dataclass(frozen=True)
class PersistentId:
    value: Any


class Rendered:
    """Opcodes rendered beforehand (``tensor``), written as they are. (A plain class: a dataclass costs ~0.4 ms
    of start-up to build.)"""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


@dataclass(frozen=True, eq=False)
class Items:
    """A dict given as (key, value) pairs: for keys that are nodes (a ``MetadataIndex``), which
    cannot be keys of a Python dict here."""

    pairs: tuple


def dumps(obj: Any) -> bytes:
    """Protocol-2 pickle of ``obj`` (a tree of the node types above and plain Python values)."""
    out = bytearray(b"\x80\x02")
    _emit(obj, out)
    out += b"."
    return bytes(out)


def _emit(obj: Any, out: bytearray) -> None:
    """Append ``obj``'s opcodes to ``out``: the writer of its exact type (one dict look-up: a Megatron rank file's
    state is thousands of nodes), else of the first type in ``_WRITERS`` it is an instance of (subclasses:
    ``TorchDtype``, ``OrderedDict``, named tuples)."""
    write = _BY_TYPE.get(type(obj))
    if write is None:
        write = next((w for cls, w in _WRITERS if isinstance(obj, cls)), None)
        if write is None:
            raise TypeError(f"pickles.dumps cannot write {type(obj).__name__} objects")
    write(obj, out)


def _w_none(obj, out: bytearray) -> None:
    out += b"N"


def _w_bool(obj, out: bytearray) -> None:
    out += b"\x88" if obj else b"\x89"


def _w_int(obj, out: bytearray) -> None:
    if 0 <= obj < 256:
        out += b"K" + bytes([obj])
    elif 0 <= obj < 65536:
        out += b"M" + struct.pack("<H", obj)
    elif -(1 << 31) <= obj < (1 << 31):
        out += b"J" + struct.pack("<i", obj)
    else:
        raw = int(obj).to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
        out += b"\x8a" + bytes([len(raw)]) + raw


def _w_float(obj, out: bytearray) -> None:
    out += b"G" + struct.pack(">d", obj)


def _w_str(obj, out: bytearray) -> None:
    raw = obj.encode("utf-8", "surrogatepass")
    out += b"X" + struct.pack("<I", len(raw)) + raw


def _w_bytes(obj, out: bytearray) -> None:
    # protocol 2 has no bytes opcode: pickle writes _codecs.encode(latin-1 text, 'latin1')
    _emit(Reduce(Global("_codecs", "encode"), (obj.decode("latin-1"), "latin1")), out)


def _w_tuple(obj, out: bytearray) -> None:
    if not obj:
        out += b")"
    elif len(obj) <= 3:
        for item in obj:
            _emit(item, out)
        out += b"\x85\x86\x87"[len(obj) - 1:len(obj)]
    else:
        out += b"("
        for item in obj:
            _emit(item, out)
        out += b"t"


def _w_list(obj, out: bytearray) -> None:
    out += b"]"
    if obj:
        out += b"("
        for item in obj:
            _emit(item, out)
        out += b"e"


def _w_pairs(pairs, out: bytearray) -> None:
    out += b"}"
    if pairs:
        out += b"("
        for key, value in pairs:
            _emit(key, out)
            _emit(value, out)
        out += b"u"


def _w_dict(obj, out: bytearray) -> None:
    _w_pairs(obj.items(), out)


def _w_items(obj, out: bytearray) -> None:
    _w_pairs(obj.pairs, out)


def _w_global(obj, out: bytearray) -> None:
    out += b"c" + obj.module.encode() + b"\n" + obj.name.encode() + b"\n"


def _w_reduce(obj, out: bytearray) -> None:
    _emit(obj.func, out)
    _emit(tuple(obj.args), out)
    out += b"R"


def _w_newobj(obj, out: bytearray) -> None:
    _emit(obj.cls, out)
    out += b")\x81"
    if obj.state:  # pickle leaves out an empty state (BytesStorageMetadata)
        _emit(obj.state, out)
        out += b"b"


def _w_persistent(obj, out: bytearray) -> None:
    _emit(obj.value, out)
    out += b"Q"


def _w_rendered(obj, out: bytearray) -> None:
    out += obj.data


# in the order the types are tried for an object of another type (a subclass); bool before int
_WRITERS = ((bool, _w_bool), (int, _w_int), (float, _w_float), (str, _w_str), (bytes, _w_bytes), (tuple, _w_tuple),
            (list, _w_list), (dict, _w_dict), (Items, _w_items), (Global, _w_global), (Reduce, _w_reduce),
            (NewObj, _w_newobj), (PersistentId, _w_persistent), (Rendered, _w_rendered))
_BY_TYPE = {type(None): _w_none, **dict(_WRITERS)}


# ------------------------------------------------------------------------------- torch vocabulary

TORCH_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                     "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
STORAGE_NAMES = {"F64": "DoubleStorage", "F32": "FloatStorage", "F16": "HalfStorage", "BF16": "BFloat16Storage",
                 "I64": "LongStorage", "I32": "IntStorage", "I16": "ShortStorage", "I8": "CharStorage",
                 "U8": "ByteStorage", "BOOL": "BoolStorage"}


def torch_dtype(tag: str) -> Global:
    """``torch.float32`` etc. (a dtype pickles as the attribute of the torch module)."""
    return Global("torch", TORCH_DTYPE_NAMES[tag])


def torch_size(shape: tuple[int, ...]) -> Reduce:
    return Reduce(Global("torch", "Size"), (tuple(int(d) for d in shape),))


def tensor_node(storage_key: str, tag: str, shape: tuple[int, ...]) -> Reduce:
    """A contiguous CPU tensor over the whole storage ``storage_key`` of a ``torch.save`` archive, as the node
    tree ``torch.save`` pickles (``torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False,
    OrderedDict())``). ``tensor`` writes the same opcodes directly."""
    numel, stride = _numel_stride(shape)
    storage = PersistentId(("storage", Global("torch", STORAGE_NAMES[tag]), storage_key, "cpu", numel))
    return Reduce(Global("torch._utils", "_rebuild_tensor_v2"),
                  (storage, 0, tuple(shape), stride, False, Reduce(Global("collections", "OrderedDict"), ())))


def _numel_stride(shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    numel, stride, acc = 1, [], 1
    for d in shape:
        numel *= d
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return numel, tuple(reversed(stride))


_TENSOR_HEAD = dumps(Global("torch._utils", "_rebuild_tensor_v2"))[2:-1] + b"(("  # the 6 arguments, the 5-tuple id
_STORAGE_OPS = {tag: dumps("storage")[2:-1] + dumps(Global("torch", name))[2:-1] for tag, name in STORAGE_NAMES.items()}
_CPU = dumps("cpu")[2:-1]
_TENSOR_TAIL = dumps(False)[2:-1] + dumps(Reduce(Global("collections", "OrderedDict"), ()))[2:-1] + b"tR"


def tensor(storage_key: str, tag: str, shape: tuple[int, ...]) -> Rendered:
    """``tensor_node``'s opcodes, written without building its node tree: a Megatron rank file pickles one per
    tensor (1,260 for a 1 GB Qwen3-MoE at TP2 x EP2), ~25 ``_emit`` calls each; here the constant parts
    are rendered once and only the key, size and shape are emitted (tests compare the two byte for byte)."""
    numel, stride = _numel_stride(shape)
    out = bytearray(_TENSOR_HEAD)
    out += _STORAGE_OPS[tag]
    _emit(storage_key, out)
    out += _CPU
    _emit(numel, out)
    out += b"tQ"  # end of the persistent id's tuple; the persistent id
    _emit(0, out)
    _emit(tuple(shape), out)
    _emit(stride, out)
    out += _TENSOR_TAIL
    return Rendered(bytes(out))


def namespace(fields: dict[str, Any]) -> NewObj:
    """An ``argparse.Namespace`` with ``fields``."""
    return NewObj(Global("argparse", "Namespace"), dict(fields))


__all__ = ["Unpickler", "read_pickle", "Opaque", "Record", "TorchDtype", "Global", "Reduce", "NewObj",
           "PersistentId", "Items", "Rendered", "dumps", "torch_dtype", "torch_size", "tensor", "tensor_node",
           "namespace"]
