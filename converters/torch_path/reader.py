"""What every torch-path reader offers the conversion engine: HF-named full tensors, one unit at a time.

Readers are thin: each wraps its format's validating checkpoint (``converters/formats``), which
checked every file and tensor once, and turns the byte ranges it lists into torch tensors (views of
the memory-mapped files where the layout allows). Readers are rebuilt inside worker processes from
``reader.reopen_args()`` (path + options), so nothing large crosses process boundaries.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Any

import torch

from converters.formats.tensors import RawTensor, StridedTensor
from converters.layout.model import Unit, all_units, model_from_config
from models.common.architecture import Architecture
from models.common.config import ModelConfig
from models.common.weight_map import WeightMap

TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}


@dataclass
class ReaderInfo:
    """Description shown by ``pmz inspect`` and used to plan writes."""

    format: str
    architecture: str
    layout: dict[str, Any] = field(default_factory=dict)
    files: int = 0
    dtype: Any = None  # torch.dtype of the stored floating-point tensors (set by every reader)
    # HF and vLLM sources whose weights come in several dtypes: which (``mixed_dtypes``); a conversion
    # without --dtype refuses them rather than narrow some values to ``dtype`` (docs/formats.md)
    mixed: str | None = None


FLOAT_TAGS = ("F64", "F32", "BF16", "F16")  # widest first; BF16 and F16 hold each other's values only in F32


def mixed_dtypes(tensors: Any) -> str | None:
    """None when every ``(name, dtype tag, file)`` shares one dtype; else one example per dtype,
    e.g. ``model.norm.weight is F32 (in model-00002-of-00002.safetensors), model.embed_tokens.weight
    BF16 (in model-00001-of-00002.safetensors)``, and the --dtype that keeps every value."""
    first: dict[str, tuple[str, str]] = {}
    for name, tag, file in sorted(tensors):
        first.setdefault(tag, (name, str(file)))
    if len(first) < 2:
        return None
    tags = sorted(first, key=lambda t: FLOAT_TAGS.index(t) if t in FLOAT_TAGS else len(FLOAT_TAGS))
    listed = ", ".join(f"{first[t][0]}{' is' if i == 0 else ''} {t} (in {first[t][1]})" for i, t in enumerate(tags))
    if tags[0] not in FLOAT_TAGS[1:]:
        return f"{listed}: no --dtype keeps every value"
    return f"{listed}: pass --dtype fp32 to keep every value"


class CheckpointReader:
    """Base class. Subclasses set ``arch``, ``hf_config``, ``cfg``, ``wmap``, ``info``."""

    arch: Architecture
    hf_config: Any
    cfg: ModelConfig
    wmap: WeightMap
    info: ReaderInfo
    path: str
    megatron = False  # a Megatron format (needs every tensor's Megatron name)

    def _set_model(self, hf_config: Any, where: str) -> None:
        """Architecture, model config and weight map from an HF config (shared by every reader)."""
        self.hf_config = hf_config
        self.arch, self.cfg, self.wmap = model_from_config(hf_config, where, self.megatron)

    def _remember_args(self, *args: Any, **kwargs: Any) -> None:
        """Record the constructor arguments, so ``reopen_args`` can rebuild this reader elsewhere."""
        self._ctor = (type(self), args, kwargs)

    def reopen_args(self) -> tuple:
        """``(callable, args)`` that rebuilds this reader in another process."""
        return _construct, self._ctor

    def units(self) -> list[Unit]:
        return all_units(self.cfg)

    def read_unit(self, unit: Unit) -> dict[str, torch.Tensor]:
        """HF name -> full tensor for every HF tensor of ``unit``."""
        raise NotImplementedError

    def read_unit_pieces(self, unit: Unit) -> dict[str, list[torch.Tensor]]:
        """Like ``read_unit``, but each tensor may come as row pieces (views into the source) whose
        concatenation along dim 0 is the tensor: writers stream them without building it."""
        return {name: [t] for name, t in self.read_unit(unit).items()}

    def validate(self) -> None:
        """Check every file and tensor the conversion will need, before anything is written."""
        raise NotImplementedError

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full HF tensor shapes implied by the config (computed once)."""
        cached = self.__dict__.get("_hf_shapes")
        if cached is None:
            from models.common.weight_map import hf_shapes

            cached = self.__dict__["_hf_shapes"] = hf_shapes(self.cfg, self.wmap)
        return cached

    def release_pages(self) -> None:
        """Let go of the resident pages of every file this reader maps (``MappedFiles.release``): called
        between units by writers that are done with the previous unit's pieces, so the mapped source does
        not stay resident as a conversion walks through it (resident memory then holds about one unit,
        whatever the checkpoint's size)."""
        for value in list(vars(self).values()):
            if isinstance(value, MappedFiles):
                value.release()

    def close(self) -> None:
        pass


def _construct(cls: type, args: tuple, kwargs: dict) -> CheckpointReader:
    return cls(*args, **kwargs)


def reopen(reopen_args: tuple) -> CheckpointReader:
    """Rebuild a reader from ``reader.reopen_args()`` (inside a worker process)."""
    factory, args = reopen_args
    return factory(*args)


class MappedFiles:
    """Source files mapped once each (private, read-only in practice): ``tensor(location)`` is a
    tensor over the bytes a validated ``RawTensor`` / ``StridedTensor`` names, without a copy."""

    def __init__(self) -> None:
        self.maps: dict[str, mmap.mmap] = {}

    def _map(self, path: str) -> mmap.mmap:
        if path not in self.maps:
            with open(path, "rb") as f:
                # ACCESS_COPY (MAP_PRIVATE): a writable buffer for torch.frombuffer; nothing writes to it
                self.maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self.maps[path]

    def release(self) -> None:
        """``madvise(MADV_DONTNEED)`` over every mapping: the pages read so far leave resident memory (they
        are clean file pages of a private mapping nothing writes to, so a later read faults them back in
        from the file, unchanged; tensors over them stay valid)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        for m in self.maps.values():
            if len(m):
                m.madvise(mmap.MADV_DONTNEED)

    def tensor(self, t: RawTensor | StridedTensor) -> torch.Tensor:
        dtype = TORCH_DTYPES[t.dtype]
        if isinstance(t, RawTensor):
            if t.numel == 0:
                return torch.empty(t.shape, dtype=dtype)
            return torch.frombuffer(self._map(t.path), dtype=dtype, count=t.numel, offset=t.offset).view(t.shape)
        if t.storage_numel == 0:
            return torch.empty(t.shape, dtype=dtype)
        storage = torch.frombuffer(self._map(t.path), dtype=dtype, count=t.storage_numel, offset=t.storage_at)
        return storage.as_strided(t.shape, t.stride, t.storage_offset)
