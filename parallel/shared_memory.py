"""Shared-memory segments every rank of a single-host job maps: a transport faster than gloo's TCP.

``SharedSegments(count, nbytes)`` is collective: global rank 0 creates ``count`` files of
``nbytes`` in ``/dev/shm`` (names broadcast), every rank maps them, then rank 0 unlinks them after
a barrier. From then on the memory lives only as long as some rank maps it: a killed job leaves
nothing in ``/dev/shm`` (except in the short window between creating and unlinking, where files
carry the ``pmz-`` prefix and the creating process id). ``segment(i, dtype, numel)`` is a tensor
view of segment ``i``. Callers order writes and reads with barriers.
"""

from __future__ import annotations

import mmap
import os
import socket
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

SHM_DIR = Path("/dev/shm")


def single_host() -> bool:
    """Every rank runs on this host and ``/dev/shm`` exists (collective when distributed)."""
    here = (socket.gethostname(), SHM_DIR.is_dir())
    if not dist.is_initialized():
        return here[1]
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, here)
    return all(h == hosts[0] for h in hosts) and here[1]


class SharedSegments:
    """``count`` shared byte segments of ``nbytes`` each, mapped by every rank (see module doc)."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.nbytes = max(int(nbytes), 1)
        rank = dist.get_rank() if dist.is_initialized() else 0
        names = [f"pmz-{os.getpid()}-{uuid.uuid4().hex[:12]}-{i}" for i in range(count)]
        if dist.is_initialized():
            box = [names]
            dist.broadcast_object_list(box, src=0)
            names = box[0]
        paths = [SHM_DIR / n for n in names]
        error = None
        if rank == 0:
            try:
                for p in paths:
                    with open(p, "wb") as f:
                        f.truncate(self.nbytes)
            except OSError as exc:
                error = f"cannot create {self.nbytes} bytes in {SHM_DIR}: {exc}"
        if dist.is_initialized():
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error:
            self._unlink(paths)
            raise OSError(error)
        self._maps = []
        try:
            for p in paths:
                with open(p, "r+b") as f:  # pages faulted in now, not during the first copies
                    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                    self._maps.append(mmap.mmap(f.fileno(), self.nbytes, flags=flags))
        finally:
            if dist.is_initialized():
                dist.barrier()
            if rank == 0:
                self._unlink(paths)
        self._bytes = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]

    @staticmethod
    def _unlink(paths) -> None:
        for p in paths:
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    def segment(self, index: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A ``numel``-element ``dtype`` view of segment ``index`` (shared by every rank)."""
        size = torch.empty((), dtype=dtype).element_size()
        if numel * size > self.nbytes:
            raise ValueError(f"{numel} x {size} bytes do not fit a {self.nbytes}-byte segment")
        return self._bytes[index][:numel * size].view(dtype)

    def close(self) -> None:
        self._bytes = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a caller still holds a view: the mapping goes with it
                pass
        self._maps = []
