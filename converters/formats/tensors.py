"""Where a tensor's bytes are, as the format readers list them (torch-free).

``RawTensor``: a contiguous row-major tensor at a byte offset of a file (safetensors entries,
contiguous ``torch.save`` storages); ``StridedTensor``: a strided view into a storage (what
``torch.save`` keeps for a view). Both are checked against their file or storage by the reader
that makes them; the copy path turns ``RawTensor`` into ``preadv``/``pwrite`` calls and the torch
path maps either as a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.common.hf_files import DTYPE_BYTES

ITEMSIZE = DTYPE_BYTES  # dtype tag (safetensors spelling) -> bytes per element
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


@dataclass(frozen=True)
class StridedTensor:
    """A tensor over a storage of ``storage_numel`` elements at byte ``storage_at`` of ``path``:
    ``shape`` with ``stride`` (elements) from element ``storage_offset`` (a view ``torch.save`` kept
    with its whole storage). The copy path leaves these to the torch path."""

    path: str
    storage_at: int
    storage_numel: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
