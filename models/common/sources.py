"""Where full (HF-named, unsharded) tensors come from, read piece by piece.

A ``TensorSource`` answers ``shape(name)`` and ``read(name, piece)``; the loader asks each rank's
pieces only, so a rank never materializes a tensor it does not hold (safetensors slices are read
through its lazy ``get_slice``; only the requested rows/columns leave the file).

  SafetensorsSource  an HF directory: ``model.safetensors`` or shards + ``model.safetensors.index.json``
  RandomSource       deterministic random weights from a seed: identical on every rank and at
                     every TP size (tensor ``name`` draws from a generator seeded by (seed, name))
  StateDictSource    an in-memory ``{name: tensor}`` (tests, export round trips)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from models.common.errors import CheckpointError  # noqa: F401 (re-exported: raised by this module's callers)
from models.common.hf_files import (  # noqa: F401 (re-exported)
    COMPANION_SUFFIXES,
    DTYPE_BYTES,
    SafetensorsFiles,
    canonical_names,
    copy_companion_files,
    read_config_json,
    read_safetensors_header,
)
from parallel.sharding import Piece, read_piece


class TensorSource:
    def names(self) -> set[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str, piece: Piece, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError


class StateDictSource(TensorSource):
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def names(self) -> set[str]:
        return set(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def read(self, name, piece, dtype=None):
        t = self.state[name]
        return read_piece(lambda idx: t[idx], tuple(t.shape), piece, dtype)


class RenamedSource(TensorSource):
    """Another source's tensors under canonical names (``rename(name)``), e.g. transformers' in-memory
    ``model.language_model.*`` read as the on-disk ``model.*``. Two names mapping to one is an error
    (``hf_files.canonical_names``, which the converters' HF reader uses too)."""

    def __init__(self, source: TensorSource, rename, where: str = "checkpoint") -> None:
        self.source = source
        self.original = canonical_names(source.names(), rename, where)

    def names(self) -> set[str]:
        return set(self.original)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(self.original[name])

    def read(self, name, piece, dtype=None):
        return self.source.read(self.original[name], piece, dtype)


class RandomSource(TensorSource):
    """Random full tensors defined by ``{name: (shape, init)}``, regenerated on demand from the seed.

    ``init`` is "normal" (std ``std``), "ones" or "zeros". A tensor's values depend only on the seed
    and its name, so every rank and every parallel layout sees the same model.
    """

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], str]], seed: int = 0, std: float = 0.02) -> None:
        self.specs = specs
        self.seed = seed
        self.std = std

    def names(self) -> set[str]:
        return set(self.specs)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.specs[name][0])

    def full(self, name: str) -> torch.Tensor:
        shape, init = self.specs[name]
        if init == "ones":
            return torch.ones(shape)
        if init == "zeros":
            return torch.zeros(shape)
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        return torch.randn(shape, generator=gen) * self.std

    def read(self, name, piece, dtype=None):
        t = self.full(name)
        return read_piece(lambda idx: t[idx], tuple(t.shape), piece, dtype)

    def state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        return {name: self.full(name).to(dtype) for name in sorted(self.specs)}


class SafetensorsSource(TensorSource):
    """Lazily-read HF safetensors checkpoint (single file or sharded with an index): names, shapes and
    files come from ``SafetensorsFiles`` (headers and index validated once, shared with the
    converters), the bytes from the safetensors library's lazy slices."""

    def __init__(self, directory: str | os.PathLike, files: SafetensorsFiles | None = None) -> None:
        """``files``: the directory's ``SafetensorsFiles`` when the caller validated it already."""
        self.directory = Path(directory)
        self.stored = files if files is not None else SafetensorsFiles(self.directory)
        self.files = self.stored.files
        self._file_of = {name: self.stored.file_of(name) for name in self.stored.tensors}
        self._shape = {name: t.shape for name, t in self.stored.tensors.items()}
        self._dtype = {name: t.dtype for name, t in self.stored.tensors.items()}
        self._handles: dict[str, object] = {}

    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def file_of(self, name: str) -> str:
        """The file (name within the directory) that holds tensor ``name``."""
        return self._file_of[name]

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype tag of ``name`` (e.g. "BF16"), read from the header."""
        return self._dtype[name]

    def _handle(self, fname: str):
        if fname not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[fname] = safe_open(str(self.directory / fname), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{self.directory / fname}: cannot open: {exc}") from exc
        return self._handles[fname]

    def read(self, name, piece, dtype=None):
        fname = self._file_of[name]
        try:
            lazy = self._handle(fname).get_slice(name)
            return read_piece(lambda idx: lazy[idx], self._shape[name], piece, dtype)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{self.directory / fname}: cannot read tensor {name!r}: {exc}") from exc

    def close(self) -> None:
        self._handles.clear()

