"""The copy path (converters/copy_path/) against the torch path: same bytes, no torch loaded.

The torch path is itself checked against transformers and real megatron-core elsewhere
(test_convert_megatron.py runs its megatron-core checkpoints through the copy path too); here the
two paths must write identical files for every source format and layout, and a CLI conversion to
HF must not import torch at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from converters.engine import convert
from tests.cases import convert_to_hf_in_fresh_python, copy_path_configs, write_hf_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("copy_path")
    cfgs = copy_path_configs()
    out = {}
    for name, cfg in cfgs.items():
        hf = write_hf_model(root, name, cfg, seed=3)
        out[(name, "hf", 1, 1, 1)] = hf
        for fmt, tp, pp, vpp in [("megatron", 2, 2, 1), ("megatron", 2, 2, 2), ("megatron", 1, 1, 1),
                                 ("megatron-dist", 2, 2, 1), ("megatron-dist", 1, 1, 1)]:
            dst = root / f"{name}-{fmt}-{tp}{pp}{vpp}"
            convert(hf, dst, to=fmt, tp=tp, pp=pp, vpp=vpp)
            out[(name, fmt, tp, pp, vpp)] = dst
    return out


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.mark.parametrize("shard", ["5GB", "20KB"])
def test_copy_path_writes_the_torch_paths_bytes(sources, tmp_path, monkeypatch, paths_taken, shard):
    used = paths_taken
    for key, src in sources.items():
        fast, slow = tmp_path / f"fast-{'-'.join(map(str, key))}", tmp_path / f"slow-{'-'.join(map(str, key))}"
        convert(src, fast, to="hf", max_shard_size=shard, workers=2)
        assert used[-1] is True, f"{key}: the copy path was not taken"
        monkeypatch.setenv("PMZ_COPY_PATH", "0")
        convert(src, slow, to="hf", max_shard_size=shard, workers=2)
        monkeypatch.delenv("PMZ_COPY_PATH")
        assert used[-1] is False
        a, b = _files(fast), _files(slow)
        assert sorted(a) == sorted(b), f"{key}: files differ: {sorted(a)} vs {sorted(b)}"
        for name in a:
            assert a[name] == b[name], f"{key}: {name} differs between the copy and the torch path"
        if shard == "20KB":
            assert len([n for n in a if n.endswith(".safetensors")]) > 1


def test_dtype_change_takes_the_torch_path(sources, tmp_path, monkeypatch, paths_taken):
    used = paths_taken
    convert(sources[("qwen2", "megatron", 2, 2, 1)], tmp_path / "bf16", to="hf", dtype="bf16")
    assert used == [False]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_cli_conversion_to_hf_never_imports_torch(sources, tmp_path):
    src = sources[("qwen2", "megatron", 2, 2, 1)]
    assert convert_to_hf_in_fresh_python(src, tmp_path / "out", tmp_path) == "NO-TORCH 0"
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_column_split_pieces_that_do_not_cover_a_row_are_refused():
    from converters.copy_path.ops import Block, rows_ops
    from converters.formats.tensors import RawTensor
    from models.common.errors import CheckpointError

    left = RawTensor("/nonexistent", 0, "F32", (4, 3))
    with pytest.raises(CheckpointError, match="cover 3 of 6 columns"):
        rows_ops([Block(0, 0, left)], (4, 6), 0, 4, "t")
    right = RawTensor("/nonexistent", 48, "F32", (4, 2))
    with pytest.raises(CheckpointError, match="columns 3..4"):
        rows_ops([Block(0, 0, left), Block(0, 4, right)], (4, 6), 0, 4, "t")


@pytest.mark.parametrize("buffer_bytes", [4096, 5000, 1 << 16])
def test_fill_file_assembles_blocks_exactly(tmp_path, buffer_bytes):
    """fill_file's block writer against the ops' meaning computed in Python: copies, column bands
    whose rows cross block boundaries (rows wider than a block too), gaps between rows, zeros left
    as holes, work items with gaps between them, several tasks filling one file."""
    import random

    from converters.copy_path.io import fill_file
    from converters.copy_path.ops import Copy, Interleave, Zeros

    rng = random.Random(0)
    src = tmp_path / "src.bin"
    data = bytes(rng.getrandbits(8) for _ in range(300_000))
    src.write_bytes(data)
    s = str(src)

    def expect(op) -> bytes:
        if isinstance(op, Copy):
            return data[op.offset:op.offset + op.n]
        if isinstance(op, Zeros):
            return bytes(op.n)
        return b"".join(data[off + r * stride:off + r * stride + rb] for r in range(op.rows)
                        for _, off, rb, stride in op.parts)

    ops_a = [Copy(s, 7, 10_001), Interleave(13, ((s, 20_000, 3000, 3000), (s, 70_001, 1234, 5000))),
             Zeros(777), Copy(s, 3, 5), Interleave(3, ((s, 100, 9000, 9100),)), Copy(s, 150_000, 40_000)]
    ops_b = [Interleave(40, ((s, 1, 17, 17), (s, 200_000, 5, 400))), Zeros(4096), Copy(s, 0, 4096)]
    len_a = sum(op.nbytes for op in ops_a)
    head = 123  # bytes before the first item, and between items, that nothing writes
    size = head + len_a + head + sum(op.nbytes for op in ops_b) + 10
    out = tmp_path / "out.bin"
    with open(out, "wb") as f:
        f.truncate(size)
    # two tasks on one file, as the HF writer cuts a shard: the second starts mid-block
    assert fill_file(str(out), [(head, ops_a[:3])], buffer_bytes) == sum(op.nbytes for op in ops_a[:3])
    first = sum(op.nbytes for op in ops_a[:3])
    fill_file(str(out), [(head + first, ops_a[3:]), (2 * head + len_a, ops_b)], buffer_bytes)
    want = bytearray(size)
    pos = head
    for op in ops_a:
        want[pos:pos + op.nbytes] = expect(op)
        pos += op.nbytes
    pos += head
    for op in ops_b:
        want[pos:pos + op.nbytes] = expect(op)
        pos += op.nbytes
    assert out.read_bytes() == bytes(want)
