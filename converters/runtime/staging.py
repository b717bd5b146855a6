"""The destination of a conversion, written atomically: a locked temp dir beside it, renamed into place.

Guarantees (for both conversion paths):
  * output goes to a temp dir ``.<dst>.tmp-<pid>-<random>`` beside the destination (missing parent
    directories are created, and removed again on failure), locked with ``flock`` for the life of
    the run; a run removes the temp dirs of earlier runs for the same destination whose lock is
    free (their owner is gone, e.g. killed with SIGKILL), never one of a live run;
  * the temp dir is renamed into place only when complete, with ``renameat2(RENAME_NOREPLACE)``: a
    destination that appeared meanwhile (a racing conversion) is refused unless ``overwrite=True``,
    which swaps it atomically (``RENAME_EXCHANGE``); on any error, Ctrl-C or SIGTERM the temp dir is
    removed and the exception propagates, the old destination untouched;
  * a failed write (disk full, read-only file system, torch.save's RuntimeError) becomes a
    CheckpointError naming the file (as it would be in the destination) and the errno text.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from converters.runtime.tasks import os_error_of
from models.common.errors import CheckpointError

try:
    import fcntl
except ImportError:  # no flock (Windows): temp dirs are not locked, and stale ones are left alone
    fcntl = None


def check_destination(dst: Path, overwrite: bool) -> None:
    """CheckpointError, before anything is read, for a destination that cannot be written: it exists
    (and ``overwrite`` is off), or its nearest existing ancestor is not a writable directory."""
    if os.path.lexists(dst) and not overwrite:
        raise CheckpointError(f"{dst}: destination exists (pass --overwrite to replace it)")
    ancestor = dst.parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise CheckpointError(f"{ancestor}: not a directory (the destination {dst} would be inside it)")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise CheckpointError(f"{ancestor}: cannot write the destination {dst} here: {os.strerror(errno.EACCES)}")


RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
_STALE_EMPTY_AFTER_S = 600  # an unlocked *empty* temp dir younger than this may be a run about to lock it
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class Staging:
    """Temp dir beside ``dst`` (parents created as needed), renamed into place on success; on failure
    the temp dir and the parents it created are removed, and OSErrors become CheckpointErrors."""

    def __init__(self, dst: Path, overwrite: bool) -> None:
        self.dst = dst
        self.overwrite = overwrite
        check_destination(dst, overwrite)
        self.tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{_token()}"
        self._created: list[Path] = []
        self._lock: int | None = None

    def __enter__(self) -> Path:
        try:
            self._created = _make_parents(self.dst.parent)
            remove_stale_temp_dirs(self.dst)
            self.tmp.mkdir()
            self._lock = _lock_dir(self.tmp)
        except OSError as exc:
            self._discard()
            where = exc.filename or self.dst.parent
            raise CheckpointError(f"{where}: cannot create the destination {self.dst}: {_errno_text(exc)}") from exc
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        # No Ctrl-C / SIGTERM half-way through publishing or cleaning up (they take effect right after).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            if exc_type is None:
                try:
                    self._publish()
                except BaseException as failure:
                    self._discard()
                    if isinstance(failure, OSError):
                        raise CheckpointError(f"{self.dst}: cannot rename {self.tmp.name} into place: "
                                              f"{_errno_text(failure)}") from failure
                    raise
                self._unlock()
                return
            self._discard()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if isinstance(exc, CheckpointError) and str(self.tmp) in str(exc):
            # the temp dir is gone: name files as they would have been in the destination
            raise CheckpointError(str(exc).replace(str(self.tmp), str(self.dst))) from exc
        if isinstance(exc, Exception) and not isinstance(exc, CheckpointError):
            err = os_error_of(exc)
            if err is not None:
                raise CheckpointError(_describe_write_error(err, self.tmp, self.dst)) from exc

    def _publish(self) -> None:
        dst, tmp = self.dst, self.tmp
        if self.overwrite and os.path.lexists(dst):
            self._replace()
            return
        try:
            if not _renameat2(tmp, dst, RENAME_NOREPLACE):
                # No renameat2 here: claim the name with mkdir (fails if it exists), then rename the
                # finished temp dir over that empty directory (allowed, and atomic).
                os.mkdir(dst)
                try:
                    os.rename(tmp, dst)
                except OSError:
                    os.rmdir(dst)
                    raise
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            if self.overwrite:
                self._replace()
                return
            raise CheckpointError(f"{dst}: destination appeared while converting (another conversion to the same "
                                  f"place?); this run's output was discarded (pass --overwrite to replace it)") from exc

    def _replace(self) -> None:
        """``tmp`` takes the place of the existing ``dst`` (atomically where RENAME_EXCHANGE works)."""
        old = self.tmp
        if not _renameat2(self.tmp, self.dst, RENAME_EXCHANGE):
            old = self.dst.parent / f".{self.dst.name}.tmp-{os.getpid()}-{_token()}"
            os.rename(self.dst, old)
            os.rename(self.tmp, self.dst)
        self._unlock()
        _remove(old)  # the previous destination, now under a temp name

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _discard(self) -> None:
        _remove(self.tmp)
        self._unlock()
        for d in reversed(self._created):  # deepest first; a directory someone else filled meanwhile stays
            try:
                d.rmdir()
            except OSError:
                break
        self._created = []


def _make_parents(parent: Path) -> list[Path]:
    """Create the missing directories down to ``parent``; returns those created, outermost first."""
    missing = []
    p = parent
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    created = []
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            if not d.is_dir():
                raise
            continue  # made by a concurrent run
        created.append(d)
    return created


def _lock_dir(path: Path) -> int | None:
    """An fd holding ``flock(LOCK_EX)`` on ``path`` for the life of the run (inherited by forked
    workers, so the lock lasts as long as any of them); None where locks are unavailable."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


def remove_stale_temp_dirs(dst: Path) -> list[Path]:
    """Remove the temp dirs of earlier conversions to ``dst`` whose owner is gone (their flock is
    free); those of live runs are locked and stay. Returns the paths removed."""
    if fcntl is None:
        return []
    pattern = re.compile(rf"\.{re.escape(dst.name)}\.tmp-\d+-[0-9a-f]{{8}}")
    try:
        entries = os.listdir(dst.parent)
    except OSError:
        return []
    removed = []
    for entry in entries:
        if not pattern.fullmatch(entry):
            continue
        path = dst.parent / entry
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live run holds it (or locks do not work here: leave it alone)
            if path.is_dir() and not os.listdir(path) and time.time() - os.fstat(fd).st_mtime < _STALE_EMPTY_AFTER_S:
                continue  # just created by a run that is about to lock it
            _remove(path)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def _token() -> str:
    return os.urandom(4).hex()  # as secrets.token_hex(4), without importing secrets (hashlib, random)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


_RENAMEAT2: Any = None


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)`` (Linux); False where the call or the flag is not available
    (no such libc function, or a file system without it), OSError when it fails otherwise."""
    global _RENAMEAT2
    if _RENAMEAT2 is None:
        _RENAMEAT2 = False
        if sys.platform.startswith("linux"):
            import ctypes

            try:
                fn = ctypes.CDLL(None, use_errno=True).renameat2
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _RENAMEAT2 = fn
            except (OSError, AttributeError):
                pass
    if not _RENAMEAT2:
        return False
    import ctypes

    at_fdcwd = -100
    if _RENAMEAT2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(src), None, str(dst))


def _errno_text(exc: OSError) -> str:
    """'No space left on device (ENOSPC)' for an OSError with an errno, its message otherwise."""
    if exc.errno in errno.errorcode:
        return f"{exc.strerror or os.strerror(exc.errno)} ({errno.errorcode[exc.errno]})"
    return " ".join(str(exc.strerror or (exc.args[0] if exc.args else exc)).split())


def _describe_write_error(err: OSError, tmp: Path, dst: Path) -> str:
    """One line naming the file (as it would be in the destination) and the errno text."""
    if err.filename is None:
        return f"{dst}: cannot write: {_errno_text(err)}"
    path = Path(os.fsdecode(err.filename))
    try:
        return f"{dst / path.relative_to(tmp)}: cannot write: {_errno_text(err)}"
    except ValueError:
        return f"{path}: {_errno_text(err)}"
