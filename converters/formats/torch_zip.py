"""``torch.save`` archives, read and laid out without torch: the zip container around a pickle and storages.

A ``torch.save`` file is an uncompressed zip: ``<prefix>/data.pkl`` (the pickle, tensors as
persistent ids naming storages), ``<prefix>/data/<key>`` (each storage's raw bytes, aligned to 64
bytes so loaders can map them), and small records (``byteorder``, ``version``, ...).

Reading (``read_torch_archive``) is the one reader of these archives (legacy Megatron rank files,
``common.pt``, torch_dist chunks) for both conversion paths: it checks the zip (entries stored, not
compressed; local headers where the central directory says; every storage inside the archive and
no two overlapping; a little-endian archive) and unpickles ``data.pkl`` with the restricted
unpickler of ``converters/formats/pickles``, tensors coming back as byte locations checked against
their storages. CheckpointError naming the file otherwise.

Writing (``layout_archive``) computes where every header and every storage goes, so the copy path
can write the headers and then fill the storages straight from the source checkpoint (``preadv``
into a buffer, ``pwrite``), in parallel, without the bytes becoming Python objects. Storage entries
carry a CRC of 0, as ``torch.save`` writes them when ``torch.serialization.config.save.compute_crc32``
is off: torch's reader does not check it, and a CRC would mean reading every byte in Python. The
pickle and the small records carry real CRCs (so ``zipfile`` can read them too). Entries or
offsets past 4 GiB use the zip64 extensions.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any

from converters.formats.pickles import Unpickler
from models.common.errors import CheckpointError

MAX_PICKLE_BYTES = 1 << 30  # data.pkl holds names and args, never tensor bytes: refuse absurd sizes

# ------------------------------------------------------------------------------------------- reading


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
    """The object a ``torch.save`` zip archive holds, tensors as ``RawTensor`` / ``StridedTensor``
    locations in ``path`` (checked to lie inside their storages, the storages inside the archive).

    ``base``/``length``: the archive is that byte range of the file (torch_dist chunks).
    """
    path = str(path)
    try:
        with open(path, "rb") as f:
            return _read_archive(f, path, base, length)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def _read_archive(f, path: str, base: int, length: int | None) -> Any:
    size = os.fstat(f.fileno()).st_size
    length = size - base if length is None else length
    if base < 0 or length < 0 or base + length > size:
        raise CheckpointError(f"{path}: truncated: an archive at bytes {base}..{base + length}, the file has {size}")
    try:
        archive = zipfile.ZipFile(_Window(f, base, length) if base or length != size else f)
        entries = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, struct.error) as exc:
        raise CheckpointError(f"{path}: not a torch.save archive or truncated ({exc})") from exc
    storages: dict[str, tuple[str, int, int]] = {}
    spans = []
    pkl = None
    for info in entries:
        parts = info.filename.split("/")
        if len(parts) == 2 and parts[1] == "data.pkl":
            pkl = info
        elif len(parts) == 3 and parts[1] == "data":
            if info.compress_type != zipfile.ZIP_STORED:
                raise CheckpointError(f"{path}: compressed storage {info.filename} (torch.save stores storages "
                                      f"uncompressed; not read)")
            f.seek(base + info.header_offset)
            head = f.read(30)
            if len(head) < 30 or head[:4] != b"PK\x03\x04":
                raise CheckpointError(f"{path}: damaged zip entry {info.filename}")
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            data_at = base + info.header_offset + 30 + name_len + extra_len
            if data_at + info.file_size > base + length:
                raise CheckpointError(f"{path}: truncated: {info.filename} needs bytes up to "
                                      f"{data_at + info.file_size}, the archive ends at {base + length}")
            storages[parts[2]] = (path, data_at, info.file_size)
            spans.append((data_at, data_at + info.file_size, info.filename))
        elif len(parts) == 2 and parts[1] == "byteorder" and _read_small(archive, info, path) not in (b"little", b""):
            raise CheckpointError(f"{path}: a big-endian archive (not read)")
    spans.sort()
    for (_, end, name), (begin, _, other) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{path}: zip entries {name} and {other} overlap")
    if pkl is None:
        raise CheckpointError(f"{path}: no data.pkl in the archive (not written by torch.save)")
    if pkl.file_size > MAX_PICKLE_BYTES:
        raise CheckpointError(f"{path}: {pkl.filename} of {pkl.file_size} bytes (over {MAX_PICKLE_BYTES}: not a "
                              f"torch.save archive)")
    try:
        return Unpickler(io.BytesIO(archive.read(pkl)), storages).load()
    except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, ValueError, TypeError, AttributeError, IndexError,
            KeyError, RecursionError, MemoryError, OverflowError, UnicodeDecodeError, struct.error, zlib.error) as exc:
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from exc


def _read_small(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: str) -> bytes:
    if info.file_size > 64:
        raise CheckpointError(f"{path}: {info.filename} of {info.file_size} bytes (a torch.save record is a word)")
    try:
        return archive.read(info).strip()
    except (zipfile.BadZipFile, ValueError, EOFError, zlib.error, struct.error) as exc:
        raise CheckpointError(f"{path}: unreadable {info.filename} ({exc})") from exc


# ------------------------------------------------------------------------------------------- writing

ALIGNMENT = 64
_U32 = 0xFFFFFFFF
_RECORDS_BEFORE = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))
_RECORDS_AFTER = (("version", b"3\n"),)


@dataclass
class _Entry:
    name: bytes
    size: int
    crc: int
    data: bytes | None  # None: a storage, filled later
    header_offset: int = 0
    data_offset: int = 0


@dataclass
class ArchiveLayout:
    """Byte layout of one archive starting at ``base`` of its file.

    ``pieces``: (absolute offset, bytes) of everything but the storages' data;
    ``storage_offsets[i]``: absolute offset of storage ``i``'s bytes; ``end``: where the archive ends.
    """

    base: int
    pieces: list[tuple[int, bytes]] = field(default_factory=list)
    storage_offsets: list[int] = field(default_factory=list)
    end: int = 0

    @property
    def size(self) -> int:
        return self.end - self.base


def layout_archive(pickle_bytes: bytes, storage_sizes: list[int], *, base: int = 0,
                   prefix: str = "archive") -> ArchiveLayout:
    """Lay out an archive holding ``pickle_bytes`` and storages ``data/0``, ``data/1``, ... of the
    given sizes (bytes), starting at ``base`` of its file."""
    entries = [_Entry(f"{prefix}/data.pkl".encode(), len(pickle_bytes), zlib.crc32(pickle_bytes), pickle_bytes)]
    entries += [_Entry(f"{prefix}/{n}".encode(), len(d), zlib.crc32(d), d) for n, d in _RECORDS_BEFORE]
    entries += [_Entry(f"{prefix}/data/{i}".encode(), int(n), 0, None) for i, n in enumerate(storage_sizes)]
    entries += [_Entry(f"{prefix}/{n}".encode(), len(d), zlib.crc32(d), d) for n, d in _RECORDS_AFTER]
    out = ArchiveLayout(base)
    pos = base
    for e in entries:
        e.header_offset = pos
        big = e.size >= _U32
        zip64 = struct.pack("<HHQQ", 1, 16, e.size, e.size) if big else b""
        start = pos + 30 + len(e.name) + len(zip64)
        pad = (base - start) % ALIGNMENT  # aligned within the archive, as torch.save does
        if pad and pad < 4:  # the padding is an extra field: 4 bytes of header at least
            pad += ALIGNMENT
        extra = zip64 + (struct.pack("<2sH", b"FB", pad - 4) + b"Z" * (pad - 4) if pad else b"")
        size32 = _U32 if big else e.size
        head = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 45 if big else 20, 0x0800, 0, 0, 0, e.crc, size32,
                           size32, len(e.name), len(extra)) + e.name + extra
        out.pieces.append((pos, head))
        e.data_offset = pos + len(head)
        if e.data is not None:
            out.pieces.append((e.data_offset, e.data))
        else:
            out.storage_offsets.append(e.data_offset)
        pos = e.data_offset + e.size
    cd_start = pos
    central = bytearray()
    for e in entries:
        rel = e.header_offset - base
        z64 = []
        size32 = e.size
        if e.size >= _U32:
            z64 += [e.size, e.size]
            size32 = _U32
        off32 = rel
        if rel >= _U32:
            z64.append(rel)
            off32 = _U32
        extra = struct.pack(f"<HH{len(z64)}Q", 1, 8 * len(z64), *z64) if z64 else b""
        central += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 45, 45 if z64 else 20, 0x0800, 0, 0, 0, e.crc,
                               size32, size32, len(e.name), len(extra), 0, 0, 0, 0, off32) + e.name + extra
    cd_rel = cd_start - base
    tail = bytearray(central)
    n = len(entries)
    if cd_rel >= _U32 or cd_rel + len(central) >= _U32 or n >= 0xFFFF:
        eocd64_rel = cd_rel + len(central)
        tail += struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, len(central), cd_rel)
        tail += struct.pack("<4sIQI", b"PK\x06\x07", 0, eocd64_rel, 1)
        tail += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, _U32, _U32, 0)
    else:
        tail += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, n, n, len(central), cd_rel, 0)
    out.pieces.append((cd_start, bytes(tail)))
    out.end = cd_start + len(tail)
    return out


def archive_bytes(pickle_bytes: bytes, storages: list[bytes] = ()) -> bytes:
    """A whole small archive in memory (``common.pt``, the extra-state entries of torch_dist)."""
    lay = layout_archive(pickle_bytes, [len(s) for s in storages])
    buf = bytearray(lay.size)
    for offset, data in lay.pieces:
        buf[offset:offset + len(data)] = data
    for offset, data in zip(lay.storage_offsets, storages):
        buf[offset:offset + len(data)] = data
    return bytes(buf)


__all__ = ["ArchiveLayout", "layout_archive", "archive_bytes", "read_torch_archive", "ALIGNMENT"]
