"""Restricted unpickling: reading a checkpoint never imports or runs code from it.

Megatron's legacy ``model_optim_rng.pt`` pickles an ``argparse.Namespace`` of training arguments
(which may reference Megatron enums, functions or classes), and torch_dist's ``.metadata`` pickles
``torch.distributed.checkpoint`` dataclasses. ``torch.load(weights_only=True)`` refuses the former;
plain ``pickle`` would import whatever the file names. Here only an allow-list of harmless globals
resolves to the real object; any other global becomes an inert ``Opaque`` placeholder that records
its name and arguments and does nothing, so the weights and plain-valued args still come through.
"""

from __future__ import annotations

import argparse
import collections
import io
import pickle
from types import SimpleNamespace
from typing import Any

import torch

from converters.raw_files import opaque_class

# (module, name) -> object for globals that may resolve to the real thing.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): argparse.Namespace,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): collections.defaultdict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray,
    ("io", "BytesIO"): io.BytesIO,
    ("_io", "BytesIO"): io.BytesIO,
    ("torch", "Size"): torch.Size,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): getattr(torch._utils, "_rebuild_tensor_v3", None),
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): getattr(torch._utils, "_rebuild_parameter_with_state", None),
    ("torch", "device"): torch.device,
}
for _dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
            torch.int8, torch.uint8, torch.bool):
    _ALLOWED[("torch", str(_dt).split(".")[1])] = _dt

# Dataclasses of torch.distributed.checkpoint metadata: plain records, safe to build.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
_DCP_NAMES = {"Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
              "TensorProperties", "_StorageInfo", "StorageMeta", "_MEM_FORMAT_ENCODING"}


class RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        obj = _ALLOWED.get((module, name))
        if obj is not None:
            return obj
        if module in _DCP_MODULES and name in _DCP_NAMES:
            return super().find_class(module, name)
        return opaque_class(module, name)


class _PickleModule(SimpleNamespace):
    """What ``torch.load(pickle_module=...)`` needs: an ``Unpickler`` and ``load``."""


restricted_pickle = _PickleModule(
    Unpickler=RestrictedUnpickler,
    load=lambda f, **kw: RestrictedUnpickler(f, **kw).load(),
    __name__="converters.safe_pickle",
)


def safe_torch_load(path, *, mmap: bool = True) -> Any:
    """``torch.load`` of a ``.pt`` file with restricted globals; tensors memory-mapped when possible."""
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=restricted_pickle, mmap=mmap)


def safe_pickle_load(fileobj) -> Any:
    """``pickle.load`` with restricted globals (for torch_dist ``.metadata``)."""
    return RestrictedUnpickler(fileobj).load()
