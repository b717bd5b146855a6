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
import json
import os
from pathlib import Path

import torch

from models.common.errors import CheckpointError  # noqa: F401 (re-exported: raised by this module's callers)
from models.common.hf_files import COMPANION_SUFFIXES, copy_companion_files, read_config_json  # noqa: F401
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
    ``model.language_model.*`` read as the on-disk ``model.*``. Two names mapping to one is an error."""

    def __init__(self, source: TensorSource, rename, where: str = "checkpoint") -> None:
        self.source = source
        self.original: dict[str, str] = {}
        for name in sorted(source.names()):
            new = rename(name)
            if new in self.original:
                raise CheckpointError(f"{where}: tensors {self.original[new]} and {name} are the same weight "
                                      f"({new}) in two key layouts")
            self.original[new] = name

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


# Bytes per element of each safetensors dtype tag.
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file, checked against the file size (catches truncation)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes)")
            n = int.from_bytes(raw, "little")
            if n <= 0 or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt safetensors header (header length {n}, file size {size})")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = info["data_offsets"]
            shape = info["shape"]
            ok = (info["dtype"] in DTYPE_BYTES and isinstance(shape, list)
                  and all(isinstance(d, int) and d >= 0 for d in shape)
                  and isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop)
            if ok:
                count = 1
                for d in shape:
                    count *= d
                ok = stop - start == count * DTYPE_BYTES[info["dtype"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors entry for tensor {name!r}") from exc
        if not ok:
            raise CheckpointError(f"{path}: corrupt safetensors entry for tensor {name!r}: {info}")
        data_end = max(data_end, stop)
    if 8 + n + data_end > size:
        raise CheckpointError(
            f"{path}: truncated: tensors need {8 + n + data_end} bytes, the file has {size}"
        )
    return header


class SafetensorsSource(TensorSource):
    """Lazily-read HF safetensors checkpoint (single file or sharded with an index); a tensor stored in
    two files is refused (CheckpointError naming both)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        single = self.directory / "model.safetensors"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: unreadable index ({exc})") from exc
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) and "/" not in v for k, v in weight_map.items()):
                raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names in this directory")
            files = sorted(set(weight_map.values()))
        elif single.exists():
            weight_map, files = None, ["model.safetensors"]
        else:
            found = sorted(p.name for p in self.directory.iterdir()) if self.directory.is_dir() else "no such directory"
            raise CheckpointError(
                f"{self.directory}: no model.safetensors or model.safetensors.index.json (found: {found})"
            )
        self._file_of: dict[str, str] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, str] = {}
        self.files = files
        for fname in files:
            path = self.directory / fname
            if not path.exists():
                raise CheckpointError(f"{path}: missing shard file listed in {index.name}")
            header = read_safetensors_header(path)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if name in self._file_of:  # which copy is meant is anyone's guess: refuse, naming both files
                    listed = f" (the index lists {weight_map[name]})" if weight_map and name in weight_map else ""
                    raise CheckpointError(f"{self.directory}: tensor {name!r} is stored twice, in "
                                          f"{self._file_of[name]} and in {fname}{listed}")
                self._file_of[name] = fname
                self._shape[name] = tuple(info["shape"])
                self._dtype[name] = info.get("dtype", "?")
        if weight_map is not None:
            for name, fname in weight_map.items():
                if self._file_of.get(name) != fname:
                    raise CheckpointError(f"{self.directory / fname}: index lists tensor {name!r} "
                                          "but the file lacks it")
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

