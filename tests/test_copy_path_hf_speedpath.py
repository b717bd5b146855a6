"""The copy-path writers' preallocation (``converters/copy_path/io.preallocate``, issue 40): the output
files are allocated with ``fallocate`` before the copy on ext4 / XFS, by the HF writer and (since
2026-11-29) the Megatron legacy / torch_dist and vLLM ``sharded_state`` writers. Same bytes with and
without it, the same bytes when the call is unavailable or refused (the writes allocate as they go), and
a full disk met by ``fallocate`` is one error naming the file, nothing left behind.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import pytest

from converters.copy_path import hf as hf_writer
from converters.copy_path import io as cio
from converters.copy_path import vectored
from converters.engine import convert
from models.common.errors import CheckpointError
from tests.cases import copy_path_configs, snapshot, write_hf_model

EXT4 = 0xEF53


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A Megatron legacy TP2 checkpoint (row and column bands: ranges and interleaved rows)."""
    root = tmp_path_factory.mktemp("hf_speedpath")
    hf = write_hf_model(root, "qwen2", copy_path_configs()["qwen2"], seed=7)
    dst = root / "legacy"
    convert(hf, dst, to="megatron", tp=2)
    return dst


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def _fake_libc(fallocate_errno: int | None, calls: list):
    """(fstatfs, fallocate, ctypes) as ``io._libc_calls`` returns them: fstatfs says ext4, fallocate fails
    with ``fallocate_errno`` (or does nothing and succeeds)."""

    def fstatfs(fd, buf):
        ctypes.c_long.from_buffer(buf).value = EXT4
        return 0

    def fallocate(fd, mode, offset, size):
        calls.append((mode, offset, size))
        if fallocate_errno is None:
            return 0
        ctypes.set_errno(fallocate_errno)
        return -1

    return lambda: (fstatfs, fallocate, ctypes)


@pytest.mark.parametrize("shard", ["5GB", "20KB"])
def test_same_bytes_with_and_without_preallocation(source, tmp_path, monkeypatch, paths_taken, shard):
    done = []
    real = hf_writer.preallocate
    monkeypatch.setattr(hf_writer, "preallocate", lambda fd, size: done.append(real(fd, size)) or done[-1])
    with_it = tmp_path / "with"
    convert(source, with_it, to="hf", max_shard_size=shard, workers=2)
    monkeypatch.setattr(cio, "_libc_calls", lambda: None)  # no ctypes / no such call: nothing preallocated
    without = tmp_path / "without"
    convert(source, without, to="hf", max_shard_size=shard, workers=2)
    assert paths_taken == [True, True]
    assert done, "the HF writer did not ask for preallocation"
    assert _files(with_it) == _files(without)
    if shard == "20KB":
        assert len([n for n in _files(with_it) if n.endswith(".safetensors")]) > 1


def test_preallocate_allocates_on_ext4_and_xfs_only(tmp_path):
    path = tmp_path / "f"
    size = 3 << 20
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, size)
        calls = cio._libc_calls()
        fs = None
        if calls is not None:
            buf = ctypes.create_string_buffer(256)
            assert calls[0](fd, buf) == 0
            fs = cio._PREALLOCATE_FS.get(ctypes.c_long.from_buffer(buf).value)
        done = cio.preallocate(fd, size)
        assert done == (fs is not None), (fs, done)
        st = os.fstat(fd)
        assert st.st_size == size
        if done:
            assert st.st_blocks * 512 >= size  # allocated, not a hole
        assert Path(path).read_bytes() == bytes(size)  # preallocated blocks read as zeros
    finally:
        os.close(fd)
    assert cio.preallocate(0, 0) is False  # nothing to allocate


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL])
def test_fallocate_refused_falls_back_to_plain_writes(source, tmp_path, monkeypatch, paths_taken, code):
    reference = tmp_path / "reference"
    monkeypatch.setattr(cio, "_libc_calls", lambda: None)
    convert(source, reference, to="hf", workers=2)
    calls: list = []
    monkeypatch.setattr(cio, "_libc_calls", _fake_libc(code, calls))
    out = tmp_path / "out"
    convert(source, out, to="hf", workers=2)
    assert calls and calls[0][:2] == (0, 0)
    assert _files(out) == _files(reference)


@pytest.mark.parametrize("code,text", [(errno.ENOSPC, "No space left on device (ENOSPC)"),
                                       (errno.EDQUOT, "(EDQUOT)")])
def test_full_disk_at_fallocate_is_one_error_naming_the_file(source, tmp_path, monkeypatch, code, text):
    before = snapshot(tmp_path)
    monkeypatch.setattr(cio, "_libc_calls", _fake_libc(code, []))
    dst = tmp_path / "out" / "ckpt"
    with pytest.raises(CheckpointError) as info:
        convert(source, dst, to="hf", workers=2)
    msg = str(info.value)
    assert "\n" not in msg and f"{dst}{os.sep}model.safetensors" in msg and text in msg, msg
    assert ".tmp-" not in msg, msg
    assert snapshot(tmp_path) == before, "the failed conversion left something behind"


def test_page_aligned_buffers_and_their_fallback(source, tmp_path, monkeypatch, paths_taken):
    """The worker threads' buffers (``vectored.page_aligned``) start on a page; where no anonymous mapping can
    be made they are plain bytearrays, and the output is the same either way."""
    buf = vectored.page_aligned(3 << 20)
    assert len(buf) == 3 << 20 and bytes(memoryview(buf)[:64]) == bytes(64)
    assert ctypes.addressof(ctypes.c_char.from_buffer(buf)) % os.sysconf("SC_PAGE_SIZE") == 0
    aligned = tmp_path / "aligned"
    convert(source, aligned, to="hf", workers=2, max_shard_size="20KB")
    import mmap

    def no_mmap(*args, **kwargs):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(mmap, "mmap", no_mmap)
    assert isinstance(vectored.page_aligned(100), bytearray)
    fallback = tmp_path / "fallback"
    convert(source, fallback, to="hf", workers=2, max_shard_size="20KB")
    assert paths_taken == [True, True]
    assert _files(aligned) == _files(fallback)


# The other copy-path writers: HF source -> (target, the file a full disk is met at, convert's options)
OTHER_TARGETS = {
    "legacy": ("megatron", "mp_rank_00/model_optim_rng.pt", {"tp": 2}),
    "torch_dist": ("megatron-dist", "__0_0.distcp", {"tp": 2}),
    "vllm": ("vllm", "model-rank-0-part-0.safetensors", {"tp": 2}),
}


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("hf_source"), "qwen2", copy_path_configs()["qwen2"], seed=8)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", sorted(OTHER_TARGETS))
def test_megatron_and_vllm_writers_preallocate_every_file_same_bytes(hf_source, tmp_path, monkeypatch, paths_taken,
                                                                     target):
    to, _, options = OTHER_TARGETS[target]
    monkeypatch.setattr(cio, "_libc_calls", lambda: None)
    reference = tmp_path / "reference"
    convert(hf_source, reference, to=to, workers=2, **options)
    calls: list = []
    monkeypatch.setattr(cio, "_libc_calls", _fake_libc(None, calls))  # "ext4", fallocate succeeds
    out = tmp_path / "out"
    convert(hf_source, out, to=to, workers=2, **options)
    assert paths_taken == [True, True]
    assert _tree(out) == _tree(reference)
    # one fallocate per tensor file, at its final size (torch_dist's small common.pt is torch.save's)
    sizes = sorted(len(data) for name, data in _tree(out).items()
                   if name.endswith((".pt", ".distcp", ".safetensors")) and not name.endswith("common.pt"))
    assert sorted(size for _, _, size in calls) == sizes, (calls, sizes)
    assert all(mode == 0 and offset == 0 for mode, offset, _ in calls)


@pytest.mark.parametrize("target", sorted(OTHER_TARGETS))
def test_full_disk_at_fallocate_other_writers_one_error_nothing_left(hf_source, tmp_path, monkeypatch, target):
    to, first_file, options = OTHER_TARGETS[target]
    before = snapshot(tmp_path)
    monkeypatch.setattr(cio, "_libc_calls", _fake_libc(errno.ENOSPC, []))
    dst = tmp_path / "out" / "ckpt"
    with pytest.raises(CheckpointError) as info:
        convert(hf_source, dst, to=to, workers=2, **options)
    msg = str(info.value)
    assert "\n" not in msg and "No space left on device (ENOSPC)" in msg, msg
    assert str(dst) in msg and ".tmp-" not in msg, msg
    assert snapshot(tmp_path) == before, "the failed conversion left something behind"
