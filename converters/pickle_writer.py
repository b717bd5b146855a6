"""Pickles of torch objects written without torch: a small protocol-2 emitter.

The copy path writes Megatron checkpoints (``torch.save`` archives, torch_dist ``.metadata``)
without importing torch, so the pickles that name torch classes cannot come from ``pickle.dumps``
of real objects. Instead the structure is described with four node types and emitted as the
opcodes ``pickle`` itself would use for the real objects:

  Global(module, name)         a class or function by name (``torch FloatStorage``, ``torch float32``)
  Reduce(func, args)           ``func(*args)`` at load time (``torch.Size((2, 3))``, tensors)
  NewObj(cls, state)           ``cls.__new__(cls)`` then ``__setstate__``/``__dict__`` update with
                               ``state`` (dataclasses, ``argparse.Namespace``)
  PersistentId(value)          a reference the loader resolves (``torch.save``'s storages)
  Items(pairs)                 a dict whose keys are nodes

plus None, bools, ints, floats, str, bytes, tuples, lists and dicts. Nothing is memoized: the
objects written here share no references, and every unpickler accepts a memo-less stream.
``tests/test_torch_free_writers.py`` checks the results against the real objects.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any


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
    if obj is None:
        out += b"N"
    elif obj is True:
        out += b"\x88"
    elif obj is False:
        out += b"\x89"
    elif isinstance(obj, int):
        if 0 <= obj < 256:
            out += b"K" + bytes([obj])
        elif 0 <= obj < 65536:
            out += b"M" + struct.pack("<H", obj)
        elif -(1 << 31) <= obj < (1 << 31):
            out += b"J" + struct.pack("<i", obj)
        else:
            raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
            out += b"\x8a" + bytes([len(raw)]) + raw
    elif isinstance(obj, float):
        out += b"G" + struct.pack(">d", obj)
    elif isinstance(obj, str):
        raw = obj.encode("utf-8", "surrogatepass")
        out += b"X" + struct.pack("<I", len(raw)) + raw
    elif isinstance(obj, bytes):
        # protocol 2 has no bytes opcode: pickle writes _codecs.encode(latin-1 text, 'latin1')
        _emit(Reduce(Global("_codecs", "encode"), (obj.decode("latin-1"), "latin1")), out)
    elif isinstance(obj, tuple):
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
    elif isinstance(obj, list):
        out += b"]"
        if obj:
            out += b"("
            for item in obj:
                _emit(item, out)
            out += b"e"
    elif isinstance(obj, dict):
        out += b"}"
        if obj:
            out += b"("
            for key, value in obj.items():
                _emit(key, out)
                _emit(value, out)
            out += b"u"
    elif isinstance(obj, Items):
        out += b"}"
        if obj.pairs:
            out += b"("
            for key, value in obj.pairs:
                _emit(key, out)
                _emit(value, out)
            out += b"u"
    elif isinstance(obj, Global):
        out += b"c" + obj.module.encode() + b"\n" + obj.name.encode() + b"\n"
    elif isinstance(obj, Reduce):
        _emit(obj.func, out)
        _emit(tuple(obj.args), out)
        out += b"R"
    elif isinstance(obj, NewObj):
        _emit(obj.cls, out)
        out += b")\x81"
        if obj.state:  # pickle leaves out an empty state (BytesStorageMetadata)
            _emit(obj.state, out)
            out += b"b"
    elif isinstance(obj, PersistentId):
        _emit(obj.value, out)
        out += b"Q"
    else:
        raise TypeError(f"pickle_writer cannot write {type(obj).__name__} objects")


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


def tensor(storage_key: str, tag: str, shape: tuple[int, ...]) -> Reduce:
    """A contiguous CPU tensor over the whole storage ``storage_key`` of a ``torch.save`` archive."""
    numel, stride, acc = 1, [], 1
    for d in shape:
        numel *= d
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    storage = PersistentId(("storage", Global("torch", STORAGE_NAMES[tag]), storage_key, "cpu", numel))
    return Reduce(Global("torch._utils", "_rebuild_tensor_v2"),
                  (storage, 0, tuple(shape), tuple(reversed(stride)), False,
                   Reduce(Global("collections", "OrderedDict"), ())))


def namespace(fields: dict[str, Any]) -> NewObj:
    """An ``argparse.Namespace`` with ``fields``."""
    return NewObj(Global("argparse", "Namespace"), dict(fields))


__all__ = ["Global", "Reduce", "NewObj", "PersistentId", "Items", "dumps", "torch_dtype", "torch_size", "tensor",
           "namespace"]
