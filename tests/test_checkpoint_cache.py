"""The session's checkpoint cache (tests/checkpoint_cache.py): one write per key, also when ranks race for it,
keyed by value, read-only, a changed entry reported and dropped, a failed build leaving nothing behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from tests import checkpoint_cache
from tests.checkpoint_cache import cached, changed, key_of
from tests.distributed import run_distributed


def write_toy(root, name: str, seed: int, log: str, pause: float = 0.0) -> str:
    """A toy "checkpoint": one file of seeded random bytes; each call appends its pid to ``log``."""
    with open(log, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    time.sleep(pause)
    path = Path(root) / name
    path.mkdir()
    (path / "weights.bin").write_bytes(torch.randn(64, generator=torch.Generator().manual_seed(seed)).numpy().tobytes())
    return str(path)


def write_elsewhere(root, name: str) -> str:
    return str(Path(root))


def write_and_fail(root, name: str, seed: int) -> str:
    (Path(root) / name).mkdir()
    (Path(root) / name / "half.bin").write_bytes(b"x")
    raise OSError("disk full (simulated)")


def _race(name: str, seed: int, log: str) -> str:
    return cached(write_toy, name, seed, log, 1.0)


def test_written_once_and_keyed_by_value(tmp_path):
    log = str(tmp_path / "calls")
    a = cached(write_toy, "toy", 1, log)
    assert cached(write_toy, "toy", 1, log) == a and Path(a).name == "toy"
    b = cached(write_toy, "toy", 2, log)
    assert b != a and Path(a, "weights.bin").read_bytes() != Path(b, "weights.bin").read_bytes()
    assert len(Path(log).read_text().split()) == 2  # one write per key
    from transformers import Qwen2Config

    def key(**kw):
        return key_of(write_toy, "toy", Qwen2Config(hidden_size=32, **kw), torch.float32)

    assert key() == key() and key() != key(vocab_size=77)  # equal configs, one key; one field more, another
    assert key_of(write_toy, "toy", 1, log) != key_of(write_toy, "other", 1, log)
    assert key_of(write_toy, "toy", 1, log) == key_of(write_toy, "toy", seed=1, log=log, pause=0.0)  # as bound
    with pytest.raises(TypeError, match="cannot key an argument of type object"):
        key_of(write_toy, "toy", object(), log)


def test_entries_are_read_only_and_a_change_is_reported_and_dropped(tmp_path):
    log = str(tmp_path / "calls")
    path = Path(cached(write_toy, "toy", 3, log))
    for p in (path, path / "weights.bin", path.parent):
        assert not os.stat(p).st_mode & 0o222, oct(os.stat(p).st_mode)
    if os.geteuid() != 0:  # the bits stop a normal user at once; root is stopped by the digest check below
        with pytest.raises(PermissionError):
            (path / "weights.bin").write_bytes(b"changed")
    os.chmod(path / "weights.bin", 0o644)
    (path / "weights.bin").write_bytes(b"changed")
    problems = changed()
    assert len(problems) == 1 and str(path.parent) in problems[0] and "weights.bin" in problems[0], problems
    assert not path.exists() and changed() == []  # dropped: reported once
    again = Path(cached(write_toy, "toy", 3, log))
    assert again == path and (again / "weights.bin").read_bytes() != b"changed"  # written again, as it was


def test_a_failed_build_leaves_nothing_and_a_wrong_path_is_refused(tmp_path):
    root = checkpoint_cache.cache_root()
    with pytest.raises(OSError, match="simulated"):
        cached(write_and_fail, "broken", 4)
    key = key_of(write_and_fail, "broken", 4)
    assert not (root / key).exists() and not list(root.glob(f".building-{key}-*"))
    with pytest.raises(RuntimeError, match="not .*elsewhere"):
        cached(write_elsewhere, "elsewhere")


def test_ranks_racing_for_one_key_write_it_once(tmp_path):
    """Two rank processes forked by the worker pool ask for the same checkpoint at once: one writes (the
    builder pauses 1 s inside, so the other arrives mid-write), both get the same complete files."""
    log = str(tmp_path / "calls")
    paths = run_distributed(2, _race, "raced", 5, log)
    assert paths[0] == paths[1] and Path(paths[0], "weights.bin").stat().st_size == 64 * 4
    assert len(Path(log).read_text().split()) == 1


def test_outside_a_session_it_says_so(monkeypatch):
    monkeypatch.delenv(checkpoint_cache.ENV)
    with pytest.raises(RuntimeError, match="PMZ_CHECKPOINT_CACHE is not set"):
        cached(write_toy, "toy", 1, "unused")


def test_copy_is_writable(tmp_path):
    src = Path(cached(write_toy, "toy", 6, str(tmp_path / "calls")))
    dst = checkpoint_cache.copy(src, tmp_path / "copy")
    (dst / "weights.bin").write_bytes(b"edited")  # a normal user can edit the copy
    (dst / "new.bin").write_bytes(b"added")
    assert os.stat(dst).st_mode & 0o200 and (src / "weights.bin").read_bytes() != b"edited"
