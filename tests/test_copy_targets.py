"""The copy path's Megatron writers (converters/copy_path/megatron.py) against the torch path.

The torch path (converters/torch_path/megatron.py, megatron_dist.write_dist) builds real tensors and
saves them with ``torch.save`` / real DCP metadata objects; it is checked against megatron-core in
test_megatron_oracle.py (which now also loads what the copy path writes). Here both paths convert
the same sources to the same layouts and ``torch.load`` / ``pickle.load`` must see the same
objects: every tensor equal (values, dtype, shape), the same keys in the same order, the same args,
the same torch_dist metadata. The pickles and zips the copy path writes by hand are also checked
against what ``pickle`` and ``torch.save`` make of the real objects, and a CLI conversion to a
Megatron format must not import torch.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from converters.engine import convert
from tests.cases import copy_path_configs, write_hf_model

ROOT = Path(__file__).resolve().parents[1]
TARGETS = [("megatron", 2, 2, 1), ("megatron", 4, 1, 1), ("megatron", 1, 2, 2), ("megatron-dist", 2, 2, 2),
           ("megatron-dist", 1, 1, 1)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("copy_targets")
    cfgs = copy_path_configs()
    out = {}
    for name, cfg in cfgs.items():
        hf = write_hf_model(root, name, cfg, seed=5)
        out[name, "hf"] = hf
        # Megatron sources written by the torch path (independent of the writers under test)
        for fmt, tp, pp, vpp in [("megatron", 2, 2, 2), ("megatron-dist", 2, 1, 1)]:
            dst = root / f"{name}-{fmt}-{tp}{pp}{vpp}"
            _torch_path(hf, dst, to=fmt, tp=tp, pp=pp, vpp=vpp)
            out[name, f"{fmt}-{tp}{pp}{vpp}"] = dst
    return out


def _torch_path(src, dst, **kw):
    old = os.environ.get("PMZ_COPY_PATH")
    os.environ["PMZ_COPY_PATH"] = "0"
    try:
        return convert(src, dst, **kw)
    finally:
        if old is None:
            del os.environ["PMZ_COPY_PATH"]
        else:
            os.environ["PMZ_COPY_PATH"] = old


def _tree(path: Path) -> list[Path]:
    return sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file())


def _same_rank_file(a: Path, b: Path) -> None:
    import argparse

    for weights_only in (False, True):  # Megatron-LM loads with weights_only=False, newer code with True
        with torch.serialization.safe_globals([argparse.Namespace]):  # as Megatron-LM allows it
            x = torch.load(a, weights_only=weights_only)
            y = torch.load(b, weights_only=weights_only)
        assert list(x) == list(y), f"{b}: top-level keys {list(y)} != {list(x)}"
        assert vars(x["args"]) == vars(y["args"]), f"{b}: args differ"
        for k in x:
            if k == "args":
                continue
            if not k.startswith("model"):
                assert x[k] == y[k] and type(x[k]) is type(y[k]), f"{b}: {k}"
                continue
            assert list(x[k]) == list(y[k]), f"{b}: key order of {k}"
            for name, t in x[k].items():
                u = y[k][name]
                if t is None:
                    assert u is None, f"{b}: {k}.{name}"
                else:
                    assert u.dtype == t.dtype and u.shape == t.shape and u.is_contiguous(), f"{b}: {k}.{name}"
                    assert torch.equal(u, t), f"{b}: {k}.{name} values differ"


def _same_dist(a: Path, b: Path) -> None:
    from converters import open_reader

    x, y = pickle.loads((a / ".metadata").read_bytes()), pickle.loads((b / ".metadata").read_bytes())
    assert x.state_dict_metadata == y.state_dict_metadata
    # archive sizes differ (torch.save adds a random serialization id and data descriptors), so
    # offsets do too; the chunks, their files and their contents must match
    assert x.storage_data.keys() == y.storage_data.keys()
    assert all(x.storage_data[k].relative_path == y.storage_data[k].relative_path for k in x.storage_data)
    cx, cy = (torch.load(d / "common.pt", weights_only=False) for d in (a, b))
    assert vars(cx.pop("args")) == vars(cy.pop("args")) and cx == cy
    ra, rb = open_reader(a), open_reader(b)
    for unit in ra.units():
        ua, ub = ra.read_unit(unit), rb.read_unit(unit)
        assert ua.keys() == ub.keys()
        for n in ua:
            assert ub[n].dtype == ua[n].dtype and torch.equal(ub[n], ua[n]), f"{b}: {n}"


@pytest.mark.parametrize("model", ["qwen2", "llama_tied_bias"])
@pytest.mark.parametrize("source", ["hf", "megatron-222", "megatron-dist-211"])
def test_copy_path_writes_what_the_torch_path_writes(sources, tmp_path, monkeypatch, model, source):
    import converters.engine as engine

    used = []
    real = engine._convert_by_copy
    monkeypatch.setattr(engine, "_convert_by_copy", lambda *a, **k: used.append(real(*a, **k)) or used[-1])
    src = sources[model, source]
    for fmt, tp, pp, vpp in TARGETS:
        slow, fast = tmp_path / f"slow-{fmt}{tp}{pp}{vpp}", tmp_path / f"fast-{fmt}{tp}{pp}{vpp}"
        _torch_path(src, slow, to=fmt, tp=tp, pp=pp, vpp=vpp)
        convert(src, fast, to=fmt, tp=tp, pp=pp, vpp=vpp, workers=2)
        assert used[-1] is True, "the copy path was not taken"
        assert _tree(fast) == _tree(slow)
        for rel in _tree(slow):
            if rel.name == "model_optim_rng.pt":
                _same_rank_file(slow / rel, fast / rel)
            elif rel.suffix not in (".distcp", ".pt") and rel.name != ".metadata":
                assert (fast / rel).read_bytes() == (slow / rel).read_bytes(), rel
        if fmt == "megatron-dist":
            it = next(p for p in _tree(slow) if p.name == ".metadata").parent
            _same_dist(slow / it, fast / it)


def test_megatron_to_megatron_keeps_the_layout_on_the_copy_path(sources, tmp_path, monkeypatch):
    import converters.engine as engine

    used = []
    real = engine._convert_by_copy
    monkeypatch.setattr(engine, "_convert_by_copy", lambda *a, **k: used.append(real(*a, **k)) or used[-1])
    src = sources["qwen2", "megatron-222"]
    convert(src, tmp_path / "same", to="megatron")
    assert used == [True], "the copy path was not taken"
    _torch_path(src, tmp_path / "slow", to="megatron")
    assert _tree(tmp_path / "same") == _tree(tmp_path / "slow")
    for rel in _tree(tmp_path / "slow"):
        if rel.name == "model_optim_rng.pt":
            _same_rank_file(tmp_path / "slow" / rel, tmp_path / "same" / rel)


@pytest.mark.parametrize("fmt", ["megatron", "megatron-dist"])
def test_small_buffers_uneven_stages_and_bf16(sources, tmp_path, fmt):
    """Multi-block fills (a 1 KiB buffer: every interleaved or scattered tensor takes many rounds),
    uneven first/last pipeline stages and bf16 storages, against the torch path's writer."""
    from converters import open_reader
    from converters.copy_path.megatron import plan_copy_target, write_megatron_by_copy
    from converters.copy_path.sources import open_raw_source
    from converters.torch_path.megatron import plan_megatron_target, write_megatron

    bf16 = tmp_path / "bf16"
    _torch_path(sources["qwen2", "hf"], bf16, to="hf", dtype="bfloat16")
    for name, src in (("hf", bf16), ("legacy", sources["qwen2", "megatron-222"])):
        layout = dict(tp=4, pp=2, vpp=1, first=1, last=3)
        slow, fast = tmp_path / f"slow-{name}", tmp_path / f"fast-{name}"
        reader = open_reader(src)
        target = plan_megatron_target(reader, dtype=reader.info.dtype, divisible_by=128,
                                      fmt="torch" if fmt == "megatron" else "torch_dist", **layout)
        slow.mkdir()
        write_megatron(reader, target, str(slow), fmt=fmt, workers=1, progress=False)
        source = open_raw_source(str(src))
        fast.mkdir()
        write_megatron_by_copy(source, plan_copy_target(source, fmt=fmt, divisible_by=128, **layout), str(fast),
                               workers=2, progress=False, buffer_bytes=1024)
        assert _tree(fast) == _tree(slow)
        for rel in _tree(slow):
            if rel.name == "model_optim_rng.pt":
                _same_rank_file(slow / rel, fast / rel)
        if fmt == "megatron-dist":
            it = next(p for p in _tree(slow) if p.name == ".metadata").parent
            _same_dist(slow / it, fast / it)


def test_a_dtype_change_takes_the_torch_path(sources, tmp_path, monkeypatch):
    import converters.copy_path.megatron as ct

    monkeypatch.setattr(ct, "write_megatron_by_copy", lambda *a, **k: pytest.fail("copy path used"))
    convert(sources["qwen2", "hf"], tmp_path / "bf16", to="megatron", dtype="bfloat16")
    state = torch.load(next((tmp_path / "bf16").rglob("model_optim_rng.pt")), weights_only=False)
    assert {t.dtype for t in state["model"].values() if t is not None} == {torch.bfloat16}


# ``pmz`` run as its module is, failing if it exits non-zero or imports torch (the copy path's promise)
_TORCH_FREE_PROBE = ("import runpy, sys\n"
                     "sys.argv = ['pmz'] + sys.argv[1:]\n"
                     "try:\n"
                     "    runpy.run_module('converters.cli', run_name='__main__')\n"
                     "except SystemExit as e:\n"
                     "    assert not e.code, e.code\n"
                     "assert 'torch' not in sys.modules, 'torch was imported'\n")


def run_pmz_without_torch(*args: str) -> None:
    """Run ``pmz <args> --quiet`` in a fresh interpreter; assert it succeeds without importing torch."""
    proc = subprocess.run([sys.executable, "-c", _TORCH_FREE_PROBE, *args, "--quiet"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_cli_conversion_to_megatron_never_imports_torch(sources, tmp_path):
    for i, (fmt, src) in enumerate([("megatron", sources["qwen2", "hf"]),
                                    ("megatron-dist", sources["qwen2", "megatron-222"])]):
        out = tmp_path / f"out{i}"
        run_pmz_without_torch("convert", str(src), str(out), "--to", fmt, "--tp", "2")
        assert (out / "latest_checkpointed_iteration.txt").is_file()


# ------------------------------------------------------------------------- the hand-made containers


def test_pickle_writer_builds_the_real_objects():
    import argparse

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from converters.formats import pickles as pw
    from converters.formats.megatron_dist import dist_metadata

    values = {"i": 7, "big": 1 << 40, "neg": -(1 << 35), "m": 300, "f": 0.1, "s": "é", "n": None, "t": True,
              "l": [1, (2, 3)], "tt": (1, 2, 3, 4), "e": (), "b": b"\x00\xff", "d": {"k": [None]}}
    ns = pickle.loads(pw.dumps(pw.namespace({**values, "dtype": pw.torch_dtype("BF16")})))
    assert ns == argparse.Namespace(**values, dtype=torch.bfloat16)
    tensors = {"w": {"size": (4, 3), "chunks": [((2, 0), (2, 3), "__1_0.distcp", 10, 20),
                                                 ((0, 0), (2, 3), "__0_0.distcp", 0, 10)]}}
    got = pickle.loads(pw.dumps(dist_metadata(tensors, [("x/shard_0_1", "__0_0.distcp", 30, 5)], "F16")))
    props = TensorProperties(dtype=torch.float16)
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in [((0, 0), (2, 3)), ((2, 0), (2, 3))]]
    want = Metadata(state_dict_metadata={"w": TensorStorageMetadata(props, torch.Size((4, 3)), chunks),
                                         "x/shard_0_1": BytesStorageMetadata()},
                    storage_data={MetadataIndex("w", torch.Size((2, 0))): _StorageInfo("__1_0.distcp", 10, 20),
                                  MetadataIndex("w", torch.Size((0, 0))): _StorageInfo("__0_0.distcp", 0, 10),
                                  MetadataIndex("x/shard_0_1"): _StorageInfo("__0_0.distcp", 30, 5)})
    assert got == want
    assert list(got.storage_data.items()) == list(want.storage_data.items())


def test_torch_zip_archives_load_in_torch_and_zipfile(tmp_path):
    import zipfile

    import numpy as np

    from converters.formats import pickles as pw
    from converters.formats.torch_zip import archive_bytes, layout_archive, read_torch_archive

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(5, dtype=np.int64)
    obj = {"a": pw.tensor("0", "F32", (3, 4)), "b": pw.tensor("1", "I64", (5,)), "c": None}
    data = archive_bytes(pw.dumps(obj), [a.tobytes(), b.tobytes()])
    for weights_only in (True, False):
        got = torch.load(io.BytesIO(data), weights_only=weights_only)
        assert torch.equal(got["a"], torch.from_numpy(a)) and torch.equal(got["b"], torch.from_numpy(b))
        assert got["c"] is None
    assert zipfile.ZipFile(io.BytesIO(data)).read("archive/data.pkl") == pw.dumps(obj)
    # zip64: a storage past 4 GiB (a sparse file), then one after it
    n = (1 << 32) + 64
    big = {"s": pw.tensor("0", "U8", (16,)), "big": pw.tensor("1", "U8", (n,)), "after": pw.tensor("2", "U8", (8,))}
    lay = layout_archive(pw.dumps(big), [16, n, 8])
    path = tmp_path / "big.pt"
    with open(path, "wb") as f:
        f.truncate(lay.end)
        for off, piece in lay.pieces + [(lay.storage_offsets[0], bytes(range(16))),
                                        (lay.storage_offsets[1] + n - 1, b"\x05"),
                                        (lay.storage_offsets[2], b"\x07" * 8)]:
            f.seek(off)
            f.write(piece)
    assert all(o % 64 == 0 for o in lay.storage_offsets)
    got = torch.load(path, mmap=True, weights_only=True)
    assert got["s"].tolist() == list(range(16)) and got["after"].tolist() == [7] * 8
    assert got["big"].shape == (n,) and int(got["big"][-1]) == 5
    raw = read_torch_archive(path)
    assert raw["after"].offset == lay.storage_offsets[2]


# ------------------------------------------------------------------------- the byte movers


def _rows_reference(data: bytes, parts, r: int, k: int) -> bytes:
    return b"".join(data[off + (r + i) * stride:off + (r + i) * stride + rb]
                    for i in range(k) for _path, off, rb, stride in parts)


@pytest.mark.parametrize("stride_extra", [0, 7, (16 << 10) + 1], ids=["contiguous", "small-gaps", "far-apart"])
def test_read_rows_places_each_part_in_its_columns(tmp_path, stride_extra):
    """``read_rows`` reads rows straight into their columns of the block: contiguous parts, parts
    whose row gaps are read into the discard buffer, and parts whose rows are read one by one."""
    from converters.copy_path.vectored import SourceFiles, read_rows

    path = tmp_path / "src.bin"
    data = os.urandom(600_000)
    path.write_bytes(data)
    rows = 9
    parts = ((str(path), 3, 5, 5 + stride_extra), (str(path), 101, 11, 11 + stride_extra), (str(path), 50_003, 1, 1))
    width = sum(p[2] for p in parts)
    fd_of = SourceFiles()
    try:
        for r, k in [(0, rows), (2, 4), (8, 1)]:
            block = memoryview(bytearray(k * width))
            read_rows(parts, fd_of, r, block, width)
            assert bytes(block) == _rows_reference(data, parts, r, k), (r, k)
        whole = ((str(path), 64, 40, 40),)
        block = memoryview(bytearray(3 * 40))
        read_rows(whole, fd_of, 1, block, 40)
        assert bytes(block) == data[104:224]
        with pytest.raises(Exception, match="ends before byte"):
            read_rows(((str(path), len(data) - 30, 20, 20),), fd_of, 0, memoryview(bytearray(40)), 20)
    finally:
        fd_of.close()


def test_vector_io_continues_short_transfers(tmp_path, monkeypatch):
    """A short ``preadv``/``pwritev`` (a nearly full disk, a signal) is continued from the byte it
    stopped at, across buffer boundaries and past IOV_MAX buffers; a write that makes no progress is
    an error, not a silent hole."""
    import converters.copy_path.vectored as cp

    src = tmp_path / "src.bin"
    data = os.urandom(5000)
    src.write_bytes(data)
    dst = tmp_path / "dst.bin"
    dst.write_bytes(b"\0" * 5000)
    real_read, real_write = os.preadv, os.pwritev

    def short(real, limit):
        def call(fd, buffers, offset):
            out, left = [], limit  # at most `limit` bytes per call, cut inside a buffer
            for b in buffers:
                if left <= 0:
                    break
                out.append(b[:left])
                left -= len(out[-1])
            return real(fd, out, offset)
        return call

    monkeypatch.setattr(cp, "_IOV_MAX", 3)
    monkeypatch.setattr(os, "preadv", short(real_read, 7))
    monkeypatch.setattr(os, "pwritev", short(real_write, 5))
    buf = bytearray(2000)
    views = [memoryview(buf)[i:i + 13] for i in range(0, 1300, 13)] + [memoryview(buf)[1300:2000]]
    fd = os.open(src, os.O_RDONLY)
    out = os.open(dst, os.O_WRONLY)
    try:
        cp.preadv_exact(fd, views, 17, "src")
        assert bytes(buf) == data[17:2017]
        cp.pwritev_all(out, views, 100)
        assert dst.read_bytes()[100:2100] == data[17:2017]
        monkeypatch.setattr(os, "pwritev", lambda fd, buffers, offset: 0)
        with pytest.raises(OSError, match="wrote nothing"):
            cp.pwritev_all(out, views, 0)
    finally:
        os.close(fd)
        os.close(out)


def test_pwrite_pieces_cuts_writes_at_the_files_multiples(tmp_path, monkeypatch):
    """``io.pwrite_pieces``: every byte lands at its offset; no write crosses a multiple of ``WRITE_BYTES`` of the
    file nor is longer than it (what keeps the page cache's folios small, see ``io.WRITE_BYTES``); a short write
    is continued."""
    import converters.copy_path.io as io

    monkeypatch.setattr(io, "WRITE_BYTES", 64)
    data = os.urandom(1000)
    dst = tmp_path / "dst.bin"
    dst.write_bytes(bytes(1200))
    calls, real = [], os.pwrite

    def record(fd, piece, offset):
        calls.append((offset, len(piece)))
        return real(fd, piece[:50], offset)  # at most 50 bytes: short writes on every full piece

    monkeypatch.setattr(os, "pwrite", record)
    fd = os.open(dst, os.O_WRONLY)
    try:
        io.pwrite_pieces(fd, memoryview(data), 37)
    finally:
        os.close(fd)
    assert dst.read_bytes() == bytes(37) + data + bytes(163)
    starts = sorted({off for off, _ in calls if off == 37 or off % 64 == 0})  # where each piece starts
    assert starts == [37, *range(64, 1037, 64)]
    assert all(n <= 64 and (off % 64 + n <= 64) for off, n in calls)


def test_scatter_bands_writes_every_ranks_band(tmp_path):
    """One read of each source row (``Copy``: into the ranks' blocks; ``Interleave``: into whole rows, each band
    written with ``pwritev``): rank t's file gets column band t of every row, also when a block (a tiny buffer) is a
    few rows."""
    from converters.copy_path.bands import scatter_bands
    from converters.copy_path.ops import Copy, Interleave

    rows, width, tp = 37, 24, 4
    src = tmp_path / "src.bin"
    data = os.urandom(10 + rows * width)
    src.write_bytes(data)
    band = width // tp
    a = 10 + 20 * width  # 20 whole rows, then 17 rows interleaved from two blocks of 10 and 14 bytes a row
    b = a + 17 * 10
    ops = [Copy(str(src), 10, 20 * width), Interleave(17, ((str(src), a, 10, 10), (str(src), b, 14, 14)))]
    full = data[10:a] + b"".join(data[a + i * 10:a + i * 10 + 10] + data[b + i * 14:b + i * 14 + 14] for i in range(17))
    outputs = []
    for t in range(tp):
        f = tmp_path / f"out{t}.bin"
        f.write_bytes(b"\xff" * (5 + rows * band))
        outputs.append((str(f), 5))
    assert scatter_bands([(ops, width, outputs)], buffer_bytes=3 * width) == rows * width
    for t, (f, _) in enumerate(outputs):
        got = Path(f).read_bytes()
        assert got[:5] == b"\xff" * 5
        assert got[5:] == b"".join(full[i * width + t * band:i * width + (t + 1) * band] for i in range(rows)), t


def test_band_grid_grows_with_the_rows_and_keeps_a_bounded_cache(monkeypatch):
    """``bands.band_grid``: read buffer ``i * tp + t`` is row ``i`` of block ``t`` (blocks ``step * band`` bytes apart),
    made only as far as the rows asked for and grown when more are asked; the grids kept stay within
    ``GRID_BUDGET`` buffers (least recently used dropped), the grid in use always kept."""
    import threading

    import converters.copy_path.bands as bands

    monkeypatch.setattr(bands, "_grids", threading.local())
    buf = memoryview(bytearray(4096))
    step, band, tp = 16, 8, 3


    buf[:] = os.urandom(4096)  # distinct bytes everywhere: a view at the wrong offset reads others
    reads, blocks = bands.band_grid(buf, step, band, tp, rows=3)
    assert len(reads) == 3 * tp and [len(b) for b in blocks] == [step * band] * tp
    reads, _ = bands.band_grid(buf, step, band, tp, rows=10)
    assert len(reads) >= 10 * tp
    for i in range(10):
        for t in range(tp):
            assert reads[i * tp + t].obj is buf.obj and len(reads[i * tp + t]) == band
            assert reads[i * tp + t].tobytes() == buf[t * step * band + i * band:][:band].tobytes(), (i, t)
    monkeypatch.setattr(bands, "GRID_BUDGET", 100)
    for b in (4, 8, 16, 32):  # four shapes of 16 rows x 3 bands: 48 buffers each
        bands.band_grid(buf, step, b, tp, rows=16)
    kept = bands._grids.cache
    assert sum(len(r) for r, _ in kept.values()) <= 100 and (id(buf.obj), step, 32, tp) in kept


def test_band_tasks_batch_groups_that_share_files(tmp_path, monkeypatch):
    """Several bands in one task (``band_tasks``: a MoE model's expert bands), of different widths, written to
    the same rank files at their own offsets, each file opened once per task: every band lands where the
    one-group call puts it, and the tasks cover every group once."""
    import converters.copy_path.bands as bands
    from converters.copy_path.ops import Copy

    monkeypatch.setattr(bands, "BAND_BATCH", 500)  # two or three groups a task
    data = os.urandom(20_000)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    tp, files = 2, [tmp_path / f"rank{t}.bin" for t in range(2)]
    for f in files:
        f.write_bytes(bytes(6000))
    groups, want, at = [], {}, 0
    for g, (rows, width) in enumerate([(9, 40), (5, 8), (30, 12), (7, 40), (11, 6)]):
        off = 100 + g * 997
        ops = [Copy(str(src), off, rows * width)]
        band = width // tp
        groups.append((ops, width, [(str(f), at) for f in files]))
        for t in range(tp):
            want[(t, at)] = b"".join(data[off + i * width + t * band:off + i * width + (t + 1) * band]
                                     for i in range(rows))
        at += rows * band + 3
    tasks = bands.band_tasks(groups, buffer_bytes=64)
    assert 1 < len(tasks) < len(groups) and [g for _, (batch, _) in tasks for g in batch] == groups
    for fn, args in tasks:
        fn(*args)
    for (t, off), expected in want.items():
        assert files[t].read_bytes()[off:off + len(expected)] == expected, (t, off)
