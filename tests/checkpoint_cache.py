"""Test checkpoints written once per pytest session, shared read-only by every module and rank process.

Several modules write the same tiny checkpoint (the same builder, name, config and seed: tests/test_moe.py and
tests/test_convert_moe.py both write Qwen2-MoE ``shared`` at seed 0). ``cached(builder, name, *args)`` runs
``builder(root, name, *args)`` once per session and returns the path of what it wrote, from then on to every
caller: the test process, and rank processes forked from the worker pool's fork server (tests/worker_pool.py
hands each rank the parent's environment, which holds the cache directory).

- Keyed by everything that decides the bytes: the builder (module and name), the checkpoint's name and every
  argument by value (a transformers config by its full JSON, dtypes and paths by name). An argument of another
  type is refused rather than keyed by identity.
- Atomic and safe with concurrent writers: one writer per key at a time (an exclusive ``flock`` on the key's lock
  file; the others wait and then read its result), and the builder writes into a private directory renamed into
  place only when complete, so a crash mid-write never leaves a checkpoint that a later caller trusts.
- Read-only: files 0444 and folders 0555, so a test that writes into a cached checkpoint fails at once for a
  normal user. Root ignores those bits (CI and these VMs run as root), so every cached checkpoint's digest is
  also recorded and ``changed()`` re-hashes them: tests/conftest.py checks after each module and fails that
  module's last test naming the checkpoint. A test that needs to change its source edits a ``copy()`` of it.

The directory comes from ``PMZ_CHECKPOINT_CACHE``, which tests/conftest.py sets to a fresh temporary directory
for each session (and removes at its end): nothing outlives the session, so a changed builder or a new
transformers can never be served a stale checkpoint.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import json
import os
import shutil
import stat
from pathlib import Path

ENV = "PMZ_CHECKPOINT_CACHE"


def _canonical(value):
    """``value`` as plain JSON data that holds everything about it that can change a checkpoint's bytes."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, os.PathLike):
        return {"path": os.fspath(value)}
    to_json = getattr(value, "to_json_string", None)  # a transformers config: every field, sorted
    if callable(to_json):
        return {"config": f"{type(value).__module__}.{type(value).__qualname__}", "json": to_json(use_diff=False)}
    import torch

    if isinstance(value, torch.dtype):
        return {"dtype": str(value)}
    raise TypeError(f"checkpoint cache: cannot key an argument of type {type(value).__name__} by value ({value!r})")


def key_of(builder, name: str, *args, **kwargs) -> str:
    """The cache key of ``builder(root, name, *args, **kwargs)``: a digest of the builder's qualified name and
    its arguments by value, bound to its parameters with their defaults filled in (``seed=0`` given or left to
    the default is one key)."""
    bound = inspect.signature(builder).bind(None, name, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(list(bound.arguments.items())[1:])  # all but the root folder
    what = {"builder": f"{builder.__module__}.{builder.__qualname__}", "arguments": _canonical(arguments)}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]
    return f"{builder.__name__.strip('_')}-{digest}"


def _digest(folder: Path) -> dict[str, str]:
    """Every path under ``folder`` with a digest of each file's bytes (folders as "dir")."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for f in sorted(filenames):
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = hashlib.sha256(fh.read()).hexdigest()
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), folder) + "/"] = "dir"
    return out


def _set_writable(folder: Path, writable: bool) -> None:
    write = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
    for dirpath, _, filenames in os.walk(folder):
        for p in [dirpath] + [os.path.join(dirpath, f) for f in filenames]:
            mode = os.stat(p).st_mode
            os.chmod(p, (mode | stat.S_IWUSR) if writable else (mode & ~write))


def cache_root() -> Path:
    root = os.environ.get(ENV)
    if not root:
        raise RuntimeError(f"{ENV} is not set: the checkpoint cache lives for one pytest session "
                           "(tests/conftest.py sets it); outside pytest, call the builder itself")
    os.makedirs(root, mode=0o700, exist_ok=True)  # made by its first user
    return Path(root)


def cached(builder, name: str, *args, **kwargs) -> str:
    """The path of ``builder(root, name, *args, **kwargs)``'s checkpoint (``root/name``), written once per session
    into the cache directory and read-only there (see the module's docstring)."""
    root = cache_root()
    key = key_of(builder, name, *args, **kwargs)
    final = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer per key; the others wait here, then find its result
        if not final.is_dir():
            building = root / f".building-{key}-{os.getpid()}"
            shutil.rmtree(building, ignore_errors=True)
            building.mkdir()
            try:
                written = Path(builder(building, name, *args, **kwargs))
                if written.resolve() != (building / name).resolve():
                    raise RuntimeError(f"checkpoint cache: {builder.__qualname__} wrote {written}, "
                                       f"not {building / name}")
                digest = json.dumps(_digest(building), sort_keys=True)
                _set_writable(building, False)
                os.rename(building, final)  # complete, or not there at all
                (root / f"{key}.digest").write_text(digest)  # (still under the lock: no reader before it)
            except BaseException:
                _set_writable(building, True)
                shutil.rmtree(building, ignore_errors=True)
                raise
    return str(final / name)


def changed() -> list[str]:
    """The cached checkpoints whose bytes or names differ from what their builder wrote, or that a test made
    writable, one line each; each is dropped from the cache (the next caller writes it again), so one test's
    mistake is reported once, not again by every later module."""
    root = os.environ.get(ENV)
    if not root or not os.path.isdir(root):
        return []
    out = []
    for record in sorted(Path(root).glob("*.digest")):
        folder = record.with_suffix("")
        now = _digest(folder) if folder.is_dir() else {}
        was = json.loads(record.read_text())
        if now != was:
            diff = sorted(set(was.items()) ^ set(now.items()))
            out.append(f"{folder}: a test changed this read-only cached checkpoint "
                       f"({', '.join(sorted({p for p, _ in diff})[:5])}); copy it before changing it")
        else:
            writable = [p for p in [folder, *folder.rglob("*")] if os.stat(p).st_mode & stat.S_IWUSR]
            if not writable:
                continue
            out.append(f"{folder}: a test made {writable[0]} writable in this read-only cached checkpoint")
        record.unlink()
        remove(folder)
    return out


def copy(src: str | Path, dst: str | Path) -> Path:
    """A writable copy of the cached checkpoint ``src`` at ``dst``, for a test that changes its source
    (``shutil.copytree`` alone keeps the read-only modes, so a normal user could not edit the copy)."""
    shutil.copytree(src, dst, copy_function=shutil.copyfile)
    _set_writable(Path(dst), True)
    return Path(dst)


def remove(root: str | Path) -> None:
    """Delete a cache directory (its read-only folders made writable first)."""
    if os.path.isdir(root):
        _set_writable(Path(root), True)
        shutil.rmtree(root, ignore_errors=True)
