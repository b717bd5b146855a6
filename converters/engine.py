"""The conversion engine: detect the source, validate it, write into a temp dir, rename at the end.

Guarantees:
  * options (sizes, counts) are checked before anything is read, and nothing is written before the
    source validated (config sizes against the tensors present, every rank file present, shapes
    consistent, no tensor missing or unused) and the target layout checked against the model;
  * output goes to a temp dir ``.<dst>.tmp-<pid>-<random>`` beside the destination (missing parent
    directories are created, and removed again on failure), locked with ``flock`` for the life of
    the run; a run removes the temp dirs of earlier runs for the same destination whose lock is
    free (their owner is gone), never one of a live run;
  * the temp dir is renamed into place only when complete, with ``renameat2(RENAME_NOREPLACE)``: a
    destination that appeared meanwhile (a racing conversion) is refused unless ``overwrite=True``,
    which swaps it atomically (``RENAME_EXCHANGE``); on any error, Ctrl-C or SIGTERM the temp dir is
    removed and the exception propagates (CLI: one line, exit 1 / 130 / 143);
  * a failed write (disk full, read-only file system, torch.save's RuntimeError) becomes a
    CheckpointError naming the file (as it would be in the destination) and the errno text;
  * work is split into tasks (byte ranges of HF files, Megatron rank files, torch_dist data files)
    run by a pool of worker processes, each rebuilding its own reader; the bytes depend only on the
    plan, never on timing or the number of workers.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from converters.checkpoint import reopen
from converters.formats import detect_format, open_reader  # noqa: F401 (part of this module's API)
from converters.megatron_sources import locate_source
from converters.tasks import os_error_of, run_tasks
from models.common.errors import CheckpointError
from models.common.sizes import parse_size  # noqa: F401 (part of this module's API)

try:
    import fcntl
except ImportError:  # no flock (Windows): temp dirs are not locked, and stale ones are left alone
    fcntl = None

if TYPE_CHECKING:
    import torch

TARGETS = ("hf", "megatron", "megatron-dist", "vllm")
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16"}


def dtype_name(name: Any) -> str | None:
    """'float32' / 'bfloat16' / 'float16' for a dtype name or torch dtype (None stays None)."""
    if name is None:
        return None
    if not isinstance(name, str):
        name = str(name).removeprefix("torch.")
    if name.lower() not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r} (choose fp32, bf16 or fp16)")
    return DTYPE_NAMES[name.lower()]


def parse_dtype(name: Any) -> torch.dtype | None:
    """The torch dtype of a name ('bf16', 'float32', ...) or torch dtype (loads torch)."""
    import torch

    canonical = dtype_name(name)
    return None if canonical is None else getattr(torch, canonical)


def check_options(*, tp: Any = None, pp: Any = None, vpp: Any = None, workers: Any = None, vocab_size: Any = None,
                  make_vocab_size_divisible_by: Any = 128, max_shard_size: Any = "5GB") -> int:
    """ValueError naming the option unless every count is a positive integer (None: not given) and
    ``max_shard_size`` a positive size; returns the shard size in bytes. Reads and writes nothing."""
    counts = {"--tp": tp, "--pp": pp, "--vpp": vpp, "--workers": workers, "--vocab-size": vocab_size,
              "--make-vocab-size-divisible-by": make_vocab_size_divisible_by}
    for option, value in counts.items():
        if value is None and option != "--make-vocab-size-divisible-by":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{option} must be a positive integer, got {value!r}")
    try:
        shard_bytes = parse_size(max_shard_size)
    except (ValueError, OverflowError, TypeError, AttributeError) as exc:
        raise ValueError(f"--max-shard-size: cannot read size {max_shard_size!r} (use e.g. 5GB, 500MB)") from exc
    if shard_bytes <= 0:
        raise ValueError(f"--max-shard-size must be a positive size, got {max_shard_size!r}")
    return shard_bytes


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


class _Staging:
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


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, to: str, tp: int | None = None, pp: int | None = None,
            vpp: int | None = None, ep: int | None = None, hf_config: str | None = None, arch: str | None = None,
            vocab_size: int | None = None, dtype: str | torch.dtype | None = None, overwrite: bool = False,
            workers: int | None = None, max_shard_size: str | int = "5GB", make_vocab_size_divisible_by: int = 128,
            progress: bool = False) -> Path:
    """Convert ``src`` (format detected) to ``to`` in ``dst``; returns the destination path.

    to: "hf", "megatron" (legacy torch, at tp/pp/vpp), "megatron-dist" (torch_dist; tp/pp/vpp
    are recorded in its args) or "vllm" (vLLM ``sharded_state`` for an engine with TP ``tp`` and
    PP ``pp``). tp/pp/vpp left at None: a Megatron target keeps a Megatron source's layout (tp
    alone; pp with vpp and uneven first/last stages), else 1; an HF target takes none of them.
    ep: expert parallelism of a Megatron target (MoE models; default: a Megatron source's, else 1).
    MoE models always take the torch path (the copy path plans dense models only).
    Missing parent directories of ``dst`` are created. Raises CheckpointError/ValueError with
    nothing left at ``dst`` (nor any directory created for it).
    """
    if to not in TARGETS:
        raise ValueError(f"unknown target format {to!r} (choose {', '.join(TARGETS)})")
    shard_bytes = check_options(tp=tp, pp=pp, vpp=vpp, workers=workers, vocab_size=vocab_size,
                                make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                max_shard_size=max_shard_size)
    if ep is not None and (isinstance(ep, bool) or not isinstance(ep, int) or ep <= 0):
        raise ValueError(f"--ep must be a positive integer, got {ep!r}")
    if to == "vllm" and ep not in (None, 1):
        raise ValueError(f"--ep {ep}: vLLM targets take no expert-parallel layout")
    given = [f"--{k} {v}" for k, v in (("tp", tp), ("pp", pp), ("vpp", vpp), ("ep", ep)) if v is not None]
    if to == "hf" and given:
        raise ValueError(f"{' '.join(given)}: an HF checkpoint has no parallel layout (--tp/--pp/--vpp apply to "
                         f"Megatron and vLLM targets)")
    if to == "vllm" and vpp not in (None, 1):
        raise ValueError(f"vLLM has no virtual pipeline stages (got --vpp {vpp})")
    wanted_dtype = dtype_name(dtype)
    dst_path = Path(dst).resolve()
    src_path = Path(src).resolve()
    if src_path == dst_path or dst_path in src_path.parents:
        raise CheckpointError(f"{dst_path}: destination is the source or contains it ({src_path})")
    check_destination(dst_path, overwrite)
    workers = workers or min(4, os.cpu_count() or 1)
    # verl actor folders, Megatron-Bridge iterations...: the folder holding the tensors, and the HF
    # config found beside it (tokenizer files come from there too) unless --hf-config is given
    location = locate_source(src)
    src, hf_config = location.path, hf_config or location.hf_config_dir
    if location.format == "hf":
        from converters.hf_config import check_hf_directory

        check_hf_directory(src)  # an absurd config.json fails here, before anything is sized by it
    # --ep > 1 is for MoE models, which the copy path leaves to the torch path anyway
    if to != "vllm" and ep in (None, 1) and _convert_by_copy(
            src, dst_path, to=to, overwrite=overwrite, hf_config=hf_config, arch=arch, vocab_size=vocab_size,
            dtype=wanted_dtype, shard_bytes=shard_bytes, workers=workers, progress=progress, tp=tp, pp=pp, vpp=vpp,
            divisible_by=make_vocab_size_divisible_by):
        return dst_path
    out_dtype = parse_dtype(wanted_dtype)
    reader = open_reader(src, arch=arch, hf_config=hf_config, vocab_size=vocab_size)
    reader.validate()
    out_dtype = out_dtype or reader.info.dtype
    if to == "vllm":
        from converters.hf import write_hf_config
        from converters.vllm import write_vllm
        from models.common.vllm_format import check_layout

        tp, pp = tp or 1, pp or 1
        check_layout(reader.cfg, tp, pp)
        with _Staging(dst_path, overwrite) as tmp:
            write_vllm(reader, str(tmp), tp=tp, pp=pp, dtype=out_dtype, max_shard_bytes=shard_bytes,
                       workers=workers, progress=progress)
            # config.json plus tokenizer files: from --hf-config, else from an HF source's own directory
            files_from = hf_config or (str(src_path) if reader.info.format == "hf" else None)
            write_hf_config(reader, str(tmp), out_dtype, files_from)
        return dst_path
    if to == "hf":
        from converters.hf import create_shard_file, hf_plan, split_file_plan, write_hf_config, write_index

        plan = hf_plan(reader, out_dtype, shard_bytes)
        with _Staging(dst_path, overwrite) as tmp:
            # Files are laid out up front; tasks fill byte ranges of them (a big file is split between
            # workers). The layout comes from the plan alone, so the bytes never depend on workers.
            tasks = []
            for f in plan:
                create_shard_file(f, str(tmp), out_dtype)
                parts = max(1, min(workers, len(f.tensors)) * 2 // max(1, len(plan)))
                tasks += [(_write_hf_range, (reader.reopen_args(), f, str(tmp), out_dtype, lo, hi))
                          for lo, hi in split_file_plan(f, parts)]
            run_tasks(tasks, workers, "writing HF shards", progress)
            write_index(plan, str(tmp), out_dtype)
            # tokenizer/generation files: from --hf-config, else from an HF source's own directory
            write_hf_config(reader, str(tmp), out_dtype, hf_config or (str(src_path) if reader.info.format == "hf"
                                                                       else None))
        return dst_path
    from converters.megatron_write import plan_megatron_target, write_megatron

    layout = source_layout(reader)
    first = last = None
    if pp is None:  # the source's stages: pp with its virtual chunks and uneven first/last stage sizes
        pp, vpp, first, last = layout["pp"], vpp or layout["vpp"], layout["first"], layout["last"]
    target = plan_megatron_target(reader, tp=tp or layout["tp"], pp=pp, vpp=vpp or 1, dtype=out_dtype,
                                  divisible_by=make_vocab_size_divisible_by, first=first, last=last,
                                  fmt="torch" if to == "megatron" else "torch_dist", ep=ep or layout["ep"])
    with _Staging(dst_path, overwrite) as tmp:
        write_megatron(reader, target, str(tmp), fmt=to, workers=workers, progress=progress,
                       hf_config_dir=hf_config)
    return dst_path


def source_layout(reader: Any) -> dict[str, Any]:
    """tp/pp/vpp (and uneven first/last stage sizes) a checkpoint was saved with: legacy readers say
    ``tp``/``pp``/``vpp`` in ``info.layout``, torch_dist ones ``saved_with_tp``/...; HF is 1/1/1."""
    layout = reader.info.layout

    def count(key: str) -> int:
        value = layout.get(key, layout.get(f"saved_with_{key}"))
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1

    out: dict[str, Any] = {"tp": count("tp"), "pp": count("pp"), "vpp": count("vpp"), "ep": count("ep"),
                           "first": None, "last": None}
    args = getattr(reader, "args", None)
    if reader.info.format in ("megatron", "megatron-dist") and args is not None:
        from converters.megatron_files import args_layout

        uneven = args_layout(args)
        out["first"], out["last"] = uneven["first"], uneven["last"]
    return out


def _convert_by_copy(src, dst_path: Path, *, to: str, overwrite: bool, hf_config, arch, vocab_size,
                     dtype: str | None, shard_bytes: int, workers: int, progress: bool, tp: int | None = None,
                     pp: int | None = None, vpp: int | None = None, divisible_by: int = 128) -> bool:
    """The copy path (no torch, byte ranges moved by system calls: ``converters/copy_plan.py`` for HF targets,
    ``converters/copy_targets.py`` for Megatron ones) when the source allows it and no dtype change
    is asked for; False when the torch path must do the conversion."""
    from converters.copy_plan import Unsupported, open_raw_source, write_hf_by_copy
    from converters.raw_files import TAG_TO_TORCH_NAME

    if os.environ.get("PMZ_COPY_PATH", "1") == "0":
        return False
    try:
        source = open_raw_source(str(src), arch=arch, hf_config=hf_config, vocab_size=vocab_size)
        tag = source.dtype()
    except Unsupported:
        return False
    if dtype is not None and dtype != TAG_TO_TORCH_NAME[tag]:
        return False
    if to == "hf":
        with _Staging(dst_path, overwrite) as tmp:
            write_hf_by_copy(source, str(tmp), max_shard_bytes=shard_bytes, workers=workers, progress=progress)
        return True
    from converters.copy_targets import plan_copy_target, write_megatron_by_copy

    # the source's layout when none is asked for, as the torch path (source_layout) does
    layout = source.layout or {}
    first = last = None
    if pp is None:
        pp, vpp = layout.get("pp", 1), vpp or layout.get("vpp", 1)
        first, last = layout.get("first"), layout.get("last")
    target = plan_copy_target(source, fmt=to, tp=tp or layout.get("tp", 1), pp=pp, vpp=vpp or 1,
                              divisible_by=divisible_by, first=first, last=last)
    with _Staging(dst_path, overwrite) as tmp:
        write_megatron_by_copy(source, target, str(tmp), workers=workers, progress=progress,
                               hf_config_dir=hf_config)
    return True


def _write_hf_range(reopen_args: tuple, plan, directory: str, dtype: torch.dtype, lo: int, hi: int) -> int:
    from converters.hf import write_shard_range

    reader = reopen(reopen_args)
    try:
        return write_shard_range(plan, directory, dtype, lo, hi, reader.read_unit_pieces)
    finally:
        reader.close()
