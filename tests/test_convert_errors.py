"""Damaged or contradictory conversion input: a clear error, nothing at the destination, CLI exit 1.

Sources are written by transformers (tests/cases.py) and converted once per module; each test
copies them and damages the copy by hand with plain torch / byte edits. For every case the API
must raise a ValueError subclass (CheckpointError for checkpoint damage) whose message names the
file / tensor / numbers involved, the destination's parent directory must be exactly as before
(no temp or half-written folders), and ``pmz convert`` must exit 1 with one line on stderr.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch

from converters import convert
from converters.cli import main
from models.common.sources import CheckpointError
from tests.cases import snapshot, write_hf_model

VOCAB = 100  # padded to 256 at tp=2 (make_vocab_size_divisible_by 128)


def _garbage(n: int, seed: int = 1234) -> bytes:
    """Reproducible junk bytes (tests must not depend on the run's randomness)."""
    return random.Random(seed).randbytes(n)


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=False)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("err_src")
    hf = write_hf_model(root, "hf", _config(), seed=3)
    convert(hf, root / "legacy_tp2", to="megatron", tp=2, workers=1)
    convert(hf, root / "dist_tp2", to="megatron-dist", tp=2, workers=2)
    return {"hf": hf, "legacy": root / "legacy_tp2", "dist": root / "dist_tp2"}


@pytest.fixture
def legacy(sources, tmp_path):
    dst = tmp_path / "src_legacy"
    shutil.copytree(sources["legacy"], dst)
    return dst


@pytest.fixture
def dist(sources, tmp_path):
    dst = tmp_path / "src_dist"
    shutil.copytree(sources["dist"], dst)
    return dst


def it_dir(ckpt: Path) -> Path:
    tracker = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    return ckpt / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")


def rank_file(ckpt: Path, tp_rank: int) -> Path:
    return it_dir(ckpt) / f"mp_rank_{tp_rank:02d}" / "model_optim_rng.pt"


def edit_pt(path: Path, fn) -> None:
    """Load a .pt file with plain torch, let ``fn`` change the dict, save it back."""
    data = torch.load(path, map_location="cpu", weights_only=False)
    fn(data)
    torch.save(data, path)


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def expect_failure(capsys, src, dst: Path, *, to: str = "hf", names: tuple[str, ...] = (),
                   exc_type: type = CheckpointError, api: dict | None = None, cli: tuple[str, ...] = (),
                   workers: tuple[int, ...] = (1,)) -> str:
    """The API raises ``exc_type`` naming ``names``; then the CLI exits 1 with one stderr line; nothing written."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    before = snapshot(dst.parent)
    msg = ""
    for w in workers:
        with pytest.raises(exc_type) as info:
            convert(src, dst, to=to, workers=w, **(api or {}))
        assert isinstance(info.value, ValueError)
        msg = str(info.value)
        for n in names:
            assert n in msg, f"error message does not name {n!r}: {msg}"
        assert snapshot(dst.parent) == before, f"workers={w}: the failed conversion left something behind"
    rc, out, err = run_cli(capsys, ["convert", str(src), str(dst), "--to", to, *cli])
    assert rc == 1, (rc, out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert lines[0].startswith("pmz convert: error:"), lines[0]
    for n in names:
        assert n in lines[0], f"CLI error does not name {n!r}: {lines[0]}"
    assert snapshot(dst.parent) == before, "the failed CLI conversion left something behind"
    return msg


# ---------------------------------------------------------------------------------------------- legacy damage


def test_missing_rank_folder(capsys, legacy, tmp_path):
    shutil.rmtree(it_dir(legacy) / "mp_rank_01")
    expect_failure(capsys, legacy, tmp_path / "out" / "hf", names=("mp_rank_01", "tp=2"))


@pytest.mark.parametrize("rank", [0, 1])
def test_truncated_rank_file(capsys, legacy, tmp_path, rank):
    f = rank_file(legacy, rank)
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])
    expect_failure(capsys, legacy, tmp_path / "out" / "hf", names=(f"mp_rank_{rank:02d}", "model_optim_rng.pt"),
                   workers=(1, 2))


@pytest.mark.parametrize("rank", [0, 1])
def test_corrupt_zip_central_directory(capsys, legacy, tmp_path, rank):
    f = rank_file(legacy, rank)
    raw = bytearray(f.read_bytes())
    entries, start = [], 0
    while (i := raw.find(b"PK\x01\x02", start)) >= 0:
        entries.append(i)
        start = i + 4
    assert len(entries) >= 3, "not a zip-format torch file?"
    mid = entries[len(entries) // 2]
    raw[mid: mid + 32] = b"\xa5" * 32  # the middle central-directory entry: signature, sizes, name length
    f.write_bytes(bytes(raw))
    expect_failure(capsys, legacy, tmp_path / "out" / "hf", names=(f"mp_rank_{rank:02d}", "model_optim_rng.pt"))


def test_cli_error_is_one_line_even_for_multiline_messages(capsys, monkeypatch):
    """Library messages (e.g. pickle's) can span lines; the CLI still prints exactly one."""
    import converters.engine as engine
    from converters.cli import main
    from models.common.sources import CheckpointError

    def boom(*a, **k):
        raise CheckpointError("first line\nsecond line")

    monkeypatch.setattr(engine, "convert", boom)
    assert main(["convert", "a", "b", "--to", "hf", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pmz convert: error: first line second line"]


def test_rank_file_replaced_with_garbage(capsys, legacy, tmp_path):
    f = rank_file(legacy, 1)
    f.write_bytes(_garbage(4096))
    expect_failure(capsys, legacy, tmp_path / "out" / "megatron", to="megatron",
                   names=("mp_rank_01", "model_optim_rng.pt"))


def test_shape_mismatch_between_tp_ranks(capsys, legacy, tmp_path):
    key = "decoder.layers.1.mlp.linear_fc2.weight"  # row-parallel: [hidden, ffn/tp] = [32, 32]

    def shrink(data):
        assert tuple(data["model"][key].shape) == (32, 32)
        data["model"][key] = torch.randn(32, 30)

    edit_pt(rank_file(legacy, 1), shrink)
    expect_failure(capsys, legacy, tmp_path / "out" / "hf", names=(key, "30"))


def test_shape_disagrees_with_config_on_every_rank(capsys, legacy, tmp_path):
    key = "decoder.layers.0.self_attention.linear_qkv.weight"  # (4 + 2*2) heads * 8 / tp 2 = 32 rows per rank

    def shrink(data):
        assert tuple(data["model"][key].shape) == (32, 32)
        data["model"][key] = data["model"][key][:24].clone()

    for rank in (0, 1):
        edit_pt(rank_file(legacy, rank), shrink)
    expect_failure(capsys, legacy, tmp_path / "out" / "hf", names=(key, "24", "32"))


def test_missing_tensor_in_rank_file(capsys, legacy, tmp_path):
    key = "decoder.layers.1.self_attention.linear_proj.weight"
    edit_pt(rank_file(legacy, 1), lambda d: d["model"].pop(key))
    expect_failure(capsys, legacy, tmp_path / "out" / "hf", names=(key, "mp_rank_01"))


def test_unexpected_extra_tensor(capsys, legacy, tmp_path):
    key = "decoder.layers.0.mlp.router.weight"
    edit_pt(rank_file(legacy, 0), lambda d: d["model"].__setitem__(key, torch.zeros(4, 32)))
    expect_failure(capsys, legacy, tmp_path / "out" / "megatron-dist", to="megatron-dist", names=(key, "mp_rank_00"))


# ---------------------------------------------------------------------------------------------- torch_dist damage


def test_truncated_distcp(capsys, dist, tmp_path):
    f = it_dir(dist) / "__1_0.distcp"
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])
    expect_failure(capsys, dist, tmp_path / "out" / "hf", names=("__1_0.distcp",), workers=(1, 2))


def test_missing_distcp(capsys, dist, tmp_path):
    (it_dir(dist) / "__0_0.distcp").unlink()
    expect_failure(capsys, dist, tmp_path / "out" / "megatron", to="megatron", names=("__0_0.distcp",))


def test_distcp_data_garbled_fails_while_writing_and_cleans_up(capsys, dist, tmp_path):
    """Same size, garbage inside: only noticed while writing, after the temp dir exists."""
    f = it_dir(dist) / "__1_0.distcp"
    raw = bytearray(f.read_bytes())
    raw[16: len(raw) - 16] = b"\x5a" * (len(raw) - 32)
    f.write_bytes(bytes(raw))
    expect_failure(capsys, dist, tmp_path / "out" / "hf", names=("decoder.",), workers=(1, 2))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "missing"])
def test_corrupt_metadata(capsys, dist, tmp_path, damage):
    f = it_dir(dist) / ".metadata"
    raw = f.read_bytes()
    if damage == "garbage":
        f.write_bytes(b"\x80\x04" + _garbage(200))
    elif damage == "truncated":
        f.write_bytes(raw[: len(raw) // 3])
    else:
        f.unlink()
    expect_failure(capsys, dist, tmp_path / "out" / "hf", names=(".metadata",))


def _edit_metadata(ckpt: Path, fn) -> None:
    """Rewrite torch_dist's .metadata with plain pickle (torch's own dataclasses)."""
    f = it_dir(ckpt) / ".metadata"
    with open(f, "rb") as fh:
        md = pickle.load(fh)
    fn(md)
    with open(f, "wb") as fh:
        pickle.dump(md, fh)


def test_dist_missing_tensor(capsys, dist, tmp_path):
    key = "decoder.final_layernorm.weight"
    _edit_metadata(dist, lambda md: md.state_dict_metadata.pop(key))
    expect_failure(capsys, dist, tmp_path / "out" / "hf", names=(key, "missing"))


def test_dist_unexpected_extra_tensor(capsys, dist, tmp_path):
    key = "decoder.layers.mlp.router.weight"

    def add(md):
        md.state_dict_metadata[key] = md.state_dict_metadata["decoder.final_layernorm.weight"]

    _edit_metadata(dist, add)
    expect_failure(capsys, dist, tmp_path / "out" / "megatron", to="megatron", names=(key,))


def test_dist_global_shape_disagrees_with_config(capsys, dist, tmp_path):
    key = "decoder.layers.mlp.linear_fc2.weight"  # stacked: [layers, hidden, ffn] = [2, 32, 64]

    def grow(md):
        meta = md.state_dict_metadata[key]
        assert tuple(meta.size) == (2, 32, 64)
        meta.size = torch.Size([2, 32, 72])

    _edit_metadata(dist, grow)
    expect_failure(capsys, dist, tmp_path / "out" / "hf", names=(key, "72", "64"))


# ---------------------------------------------------------------------------------------------- unsupported args


@pytest.mark.parametrize("change,named", [({"normalization": "LayerNorm"}, "normalization=LayerNorm"),
                                          ({"swiglu": False}, "swiglu=False")])
@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_unknown_architecture_in_args(capsys, legacy, dist, tmp_path, change, named, fmt):
    from models.common.config import UnsupportedConfigError

    src = legacy if fmt == "legacy" else dist
    files = ([rank_file(legacy, 0), rank_file(legacy, 1)] if fmt == "legacy" else [it_dir(dist) / "common.pt"])
    for f in files:
        edit_pt(f, lambda d: [setattr(d["args"], k, v) for k, v in change.items()])
    shutil.rmtree(src / "hf_config")  # otherwise the sidecar config is used instead of the args
    expect_failure(capsys, src, tmp_path / "out" / "hf", names=(named,), exc_type=UnsupportedConfigError)


@pytest.mark.parametrize("change,named", [({"normalization": "LayerNorm"}, "normalization"),
                                          ({"swiglu": False}, "swiglu")])
def test_args_contradicting_the_hf_config_sidecar(capsys, legacy, tmp_path, change, named):
    """The hf_config/ folder our writer leaves says llama (RMSNorm, SwiGLU); args that say otherwise
    describe a model llama cannot compute; converting it silently would give a wrong model."""
    for rank in (0, 1):
        edit_pt(rank_file(legacy, rank), lambda d: [setattr(d["args"], k, v) for k, v in change.items()])
    expect_failure(capsys, legacy, tmp_path / "out" / "hf", names=(named,), exc_type=ValueError)


def test_target_tp_does_not_divide_heads(capsys, sources, tmp_path):
    from parallel.config import ParallelConfigError

    expect_failure(capsys, sources["hf"], tmp_path / "out" / "megatron", to="megatron", api={"tp": 3},
                   cli=("--tp", "3"), names=("tp=3", "num_attention_heads=4"), exc_type=ParallelConfigError)


def test_bridge_target_tp_must_divide_the_vocabulary(capsys, tmp_path):
    """Megatron-Bridge keeps the HF vocabulary unpadded (its providers' should_pad_vocab=False) and megatron-core
    divides it by tp when it builds the embedding: --to megatron-bridge --tp 2 of a 101-token vocabulary is refused
    before anything is written, naming the numbers; the padded Megatron targets take the same model at tp=2."""
    from transformers import LlamaConfig

    from parallel.config import ParallelConfigError

    cfg = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    hf = write_hf_model(tmp_path, "hf101", cfg, seed=5)
    expect_failure(capsys, hf, tmp_path / "out" / "bridge", to="megatron-bridge", api={"tp": 2}, cli=("--tp", "2"),
                   names=("vocab_size=101", "tp=2", "should_pad_vocab"), exc_type=ParallelConfigError)
    convert(hf, tmp_path / "out" / "legacy", to="megatron", tp=2, workers=1)  # padded to 256: fine
    assert (tmp_path / "out" / "legacy" / "latest_checkpointed_iteration.txt").exists()


def test_padded_vocab_only_needs_vocab_size_or_hf_config(capsys, legacy, sources, tmp_path):
    from safetensors.torch import load_file

    for rank in (0, 1):
        edit_pt(rank_file(legacy, rank), lambda d: setattr(d["args"], "vocab_size", None))
    shutil.rmtree(legacy / "hf_config")
    msg = expect_failure(capsys, legacy, tmp_path / "out" / "hf", names=("--vocab-size", "--hf-config", "256"))
    assert "padded" in msg

    # With the real size given, the conversion works and gives back transformers' tensors bitwise.
    original = load_file(str(Path(sources["hf"]) / "model.safetensors"))
    for kw in ({"vocab_size": VOCAB}, {"hf_config": str(sources["hf"])}):
        out = tmp_path / f"ok_{next(iter(kw))}"
        convert(legacy, out, to="hf", workers=1, **kw)
        got = load_file(str(out / "model.safetensors"))
        assert got.keys() == original.keys()
        assert all(torch.equal(got[k], original[k]) for k in original)


# ---------------------------------------------------------------------------------------------- destinations


def test_existing_destination_needs_overwrite(capsys, sources, tmp_path):
    from safetensors.torch import load_file

    parent = tmp_path / "out"
    dst = parent / "hf"
    dst.mkdir(parents=True)
    (dst / "keep.txt").write_text("precious")
    msg = expect_failure(capsys, sources["legacy"], dst, names=(str(dst), "--overwrite"))
    assert (dst / "keep.txt").read_text() == "precious"
    assert "exists" in msg

    convert(sources["legacy"], dst, to="hf", overwrite=True, workers=2)
    assert not (dst / "keep.txt").exists()
    assert sorted(p.name for p in parent.iterdir()) == ["hf"], "temp/old folders left beside the destination"
    original = load_file(str(Path(sources["hf"]) / "model.safetensors"))
    got = load_file(str(dst / "model.safetensors"))
    assert got.keys() == original.keys() and all(torch.equal(got[k], original[k]) for k in original)

    (dst / "keep.txt").write_text("again")
    rc, out, err = run_cli(capsys, ["convert", str(sources["dist"]), str(dst), "--to", "hf", "--overwrite", "--quiet"])
    assert rc == 0, err
    assert not (dst / "keep.txt").exists()
    assert sorted(p.name for p in parent.iterdir()) == ["hf"]
    got = load_file(str(dst / "model.safetensors"))
    assert all(torch.equal(got[k], original[k]) for k in original)


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("spelling", ["same", "dotdot"])
def test_destination_is_source(capsys, legacy, overwrite, spelling):
    dst = legacy if spelling == "same" else legacy / ".." / legacy.name
    before = snapshot(legacy.parent)
    with pytest.raises(CheckpointError) as info:
        convert(legacy, dst, to="megatron", overwrite=overwrite, workers=1)
    assert "source" in str(info.value) and legacy.name in str(info.value)
    argv = ["convert", str(legacy), str(dst), "--to", "megatron"] + (["--overwrite"] if overwrite else [])
    rc, _, err = run_cli(capsys, argv)
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert snapshot(legacy.parent) == before


def test_unknown_target_format(capsys, sources, tmp_path):
    dst = tmp_path / "out" / "x"
    dst.parent.mkdir()
    with pytest.raises(ValueError) as info:
        convert(sources["hf"], dst, to="gguf")
    assert "gguf" in str(info.value)
    # argparse rejects the choice itself (usage error: exit status 2, by argparse convention)
    capsys.readouterr()
    with pytest.raises(SystemExit) as ex:
        main(["convert", str(sources["hf"]), str(dst), "--to", "gguf"])
    assert ex.value.code != 0
    assert "gguf" in capsys.readouterr().err
    assert list(dst.parent.iterdir()) == []


def test_missing_source(capsys, tmp_path):
    missing = tmp_path / "does_not_exist"
    expect_failure(capsys, missing, tmp_path / "out" / "hf", names=(str(missing),))


def test_source_that_is_no_checkpoint(capsys, tmp_path):
    src = tmp_path / "empty_src"
    src.mkdir()
    (src / "notes.txt").write_text("hello")
    expect_failure(capsys, src, tmp_path / "out" / "hf", names=(str(src), "not a recognized checkpoint"))


# ---------------------------------------------------------------------------------------------- no code from pickles


class RunsCode:
    """Pickles as a call to ``func(*args)``: what a malicious checkpoint would contain."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _payloads(marker: Path):
    import builtins

    return {"os.system": RunsCode(os.system, f"touch {marker}"),
            "builtins.exec": RunsCode(builtins.exec, f"open({str(marker)!r}, 'w').close()")}


@pytest.mark.parametrize("payload", ["os.system", "builtins.exec"])
@pytest.mark.parametrize("where", ["legacy_args", "dist_common", "dist_metadata"])
def test_pickled_globals_never_run(capsys, legacy, dist, tmp_path, payload, where):
    marker = tmp_path / "pwned_marker"
    evil = _payloads(marker)[payload]
    # sanity: unpickling with plain pickle WOULD run it
    pickle.loads(pickle.dumps(evil))
    assert marker.exists()
    marker.unlink()

    if where == "legacy_args":
        src = legacy
        for rank in (0, 1):
            edit_pt(rank_file(legacy, rank), lambda d: setattr(d["args"], "tokenizer_hook", evil))
    elif where == "dist_common":
        src = dist
        edit_pt(it_dir(dist) / "common.pt", lambda d: setattr(d["args"], "tokenizer_hook", evil))
    else:
        src = dist
        (it_dir(dist) / ".metadata").write_bytes(pickle.dumps(evil))

    try:
        convert(src, tmp_path / "out_api", to="hf", workers=2)
    except ValueError:
        pass
    main(["inspect", str(src)])
    main(["convert", str(src), str(tmp_path / "out_cli"), "--to", "megatron", "--quiet"])
    main(["verify", str(src), str(src)])
    capsys.readouterr()
    assert not marker.exists(), f"code from a pickled {payload} ran while reading {where}"


# ---------------------------------------------------------------------------------------------- options


@pytest.mark.parametrize("option,value", [("tp", 0), ("pp", -1), ("vpp", 0), ("workers", 0), ("vocab_size", 0),
                                          ("make_vocab_size_divisible_by", 0), ("make_vocab_size_divisible_by", -128),
                                          ("max_shard_size", "0"), ("max_shard_size", "-5GB"),
                                          ("max_shard_size", "lots"), ("max_shard_size", "infGB"),
                                          ("max_shard_size", 0)])
def test_bad_option_fails_before_anything_is_read(capsys, tmp_path, option, value):
    """The source does not even exist: the option must be what the error names. CLI: exit 2, one line."""
    src, dst = tmp_path / "no_such_source", tmp_path / "out" / "x"
    flag = "--" + option.replace("_", "-")
    with pytest.raises(ValueError) as info:
        convert(src, dst, to="megatron", **{option: value})
    assert flag in str(info.value) and "no_such_source" not in str(info.value), str(info.value)
    capsys.readouterr()
    with pytest.raises(SystemExit) as ex:
        main(["convert", str(src), str(dst), "--to", "megatron", f"{flag}={value}"])
    assert ex.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pmz convert: error: argument " + flag), lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("given", [{"tp": 2}, {"pp": 1}, {"vpp": 2}, {"tp": 1, "pp": 2}])
def test_parallel_layout_for_an_hf_target_is_an_error(capsys, sources, tmp_path, given):
    dst = tmp_path / "out" / "hf"
    with pytest.raises(ValueError) as info:
        convert(sources["legacy"], dst, to="hf", **given)
    assert all(f"--{k} {v}" in str(info.value) for k, v in given.items()), str(info.value)
    capsys.readouterr()
    argv = ["convert", str(sources["legacy"]), str(dst), "--to", "hf"]
    rc = main(argv + [x for k, v in given.items() for x in (f"--{k}", str(v))])
    assert rc == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and all(f"--{k}" in lines[0] for k in given), lines
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- sizes and shards


def _hf_copy_with_config(src: Path, dst: Path, **changes) -> Path:
    import json

    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    data.update(changes)
    (dst / "config.json").write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize("changes,named", [({"num_hidden_layers": 3}, ("num_hidden_layers=3", "2 layer(s)")),
                                           ({"num_hidden_layers": 10**9}, ("num_hidden_layers=1000000000",)),
                                           ({"vocab_size": 101}, ("vocab_size=101", "(100, 32)", "model.safetensors")),
                                           ({"hidden_size": 2**40}, (f"hidden_size={2**40}", "(100, 32)"))])
@pytest.mark.parametrize("to", ["hf", "megatron"])
def test_config_sizes_checked_against_the_tensors_present(capsys, sources, tmp_path, changes, named, to):
    src = _hf_copy_with_config(Path(sources["hf"]), tmp_path / "src", **changes)
    expect_failure(capsys, src, tmp_path / "out" / "x", to=to, names=(str(src / "config.json"), *named))


def _sharded(sources, tmp_path: Path) -> Path:
    """The HF source re-written in several shards with an index (by our own writer)."""
    out = tmp_path / "sharded"
    convert(sources["hf"], out, to="hf", max_shard_size="20KB", workers=1)
    assert len(list(out.glob("model-*.safetensors"))) >= 3
    return out


@pytest.mark.parametrize("to", ["hf", "megatron"])
def test_tensor_stored_in_two_shards_names_both_files(capsys, sources, tmp_path, to):
    import json

    from safetensors.torch import load_file, save_file

    src = _sharded(sources, tmp_path)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.mlp.down_proj.weight"
    home = index[name]
    other = next(f for f in sorted(set(index.values())) if f != home)
    tensors = load_file(str(src / other))
    tensors[name] = load_file(str(src / home))[name].clone()
    save_file(tensors, str(src / other), metadata={"format": "pt"})
    msg = expect_failure(capsys, src, tmp_path / "out" / "x", to=to, names=(name, home, other))
    assert "lacks it" not in msg, msg  # it was blamed on a file that does hold it


def test_safetensors_source_names_both_files_of_a_duplicate(sources, tmp_path):
    from safetensors.torch import load_file, save_file

    from models.common.sources import SafetensorsSource

    src = _sharded(sources, tmp_path)
    first, second = sorted(src.glob("model-*.safetensors"))[:2]
    name = next(iter(load_file(str(first))))
    tensors = load_file(str(second))
    tensors[name] = load_file(str(first))[name]
    save_file(tensors, str(second), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        SafetensorsSource(src)
    assert name in str(info.value) and first.name in str(info.value) and second.name in str(info.value)


# ---------------------------------------------------------------------------------------------- writing fails


class _FullDisk(io.FileIO):
    """A file on a full disk: opening works, writing and growing it fail with ENOSPC."""

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def truncate(self, size=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _open_on_full_disk(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+"):
        return _FullDisk(file, mode.replace("b", "").replace("t", ""))
    return open(file, mode, *args, **kwargs)


@pytest.mark.parametrize("to,module,named", [
    ("megatron", "converters.torch_path.megatron_legacy", "mp_rank_00/model_optim_rng.pt"),  # torch.save's error
    ("megatron-dist", "converters.torch_path.megatron_dist", ".distcp"),
    ("hf", "converters.copy_path.hf", "model.safetensors"),  # the copy path from here on
    ("megatron", "converters.copy_path.megatron", "mp_rank_00/model_optim_rng.pt"),
    ("megatron-dist", "converters.copy_path.megatron", ".distcp"),
])
def test_disk_full_names_the_file_and_errno(capsys, monkeypatch, sources, tmp_path, to, module, named):
    import importlib

    if module in ("converters.torch_path.megatron_legacy", "converters.torch_path.megatron_dist"):
        monkeypatch.setenv("PMZ_COPY_PATH", "0")  # the torch path's writers
    monkeypatch.setattr(importlib.import_module(module), "open", _open_on_full_disk, raising=False)
    dst = tmp_path / "out" / "x"
    for source in (sources["hf"], sources["legacy"]):
        before = snapshot(tmp_path)
        with pytest.raises(CheckpointError) as info:
            convert(source, dst, to=to, workers=1)
        msg = str(info.value)
        assert str(dst) in msg and named in msg and "No space left on device (ENOSPC)" in msg, msg
        assert "inline_container" not in msg and "tmp-" not in msg, msg
        assert snapshot(tmp_path) == before, "the failed conversion left something behind"
    rc, out, err = run_cli(capsys, ["convert", str(sources["hf"]), str(dst), "--to", to, "--workers", "1",
                                    "--quiet"])
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "ENOSPC" in err, err


# ---------------------------------------------------------------------------------------------- destinations


def test_missing_parents_are_created_and_removed_on_failure(capsys, sources, dist, tmp_path):
    from safetensors.torch import load_file

    dst = tmp_path / "new" / "deeper" / "hf"
    convert(sources["legacy"], dst, to="hf", workers=1)
    original = load_file(str(Path(sources["hf"]) / "model.safetensors"))
    assert load_file(str(dst / "model.safetensors")).keys() == original.keys()

    f = it_dir(dist) / "__1_0.distcp"  # damage noticed only while writing, after the parents exist
    raw = bytearray(f.read_bytes())
    raw[16: len(raw) - 16] = b"\x5a" * (len(raw) - 32)
    f.write_bytes(bytes(raw))
    for to in ("hf", "megatron"):
        with pytest.raises(CheckpointError):
            convert(dist, tmp_path / "other" / "deeper" / "x", to=to, workers=2)
        assert not (tmp_path / "other").exists(), "the directories created for the destination are still there"
    rc, _, err = run_cli(capsys, ["convert", str(dist), str(tmp_path / "other" / "x"), "--to", "hf", "--quiet"])
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "other").exists()


def test_destination_parent_is_a_file(capsys, sources, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for dst in (afile / "hf", afile / "sub" / "hf"):
        with pytest.raises(CheckpointError) as info:
            convert(sources["hf"], dst, to="hf")
        assert str(afile) in str(info.value) and "not a directory" in str(info.value)
        rc, _, err = run_cli(capsys, ["convert", str(sources["hf"]), str(dst), "--to", "hf"])
        assert rc == 1 and len(err.strip().splitlines()) == 1 and str(afile) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and afile.read_text() == "x"


@pytest.mark.parametrize("renameat2", [True, False], ids=["renameat2", "fallback"])
@pytest.mark.parametrize("to", ["hf", "megatron"])
def test_destination_created_during_the_conversion(capsys, monkeypatch, sources, tmp_path, renameat2, to):
    """Another process creates the destination while we convert: refused (named) without --overwrite,
    its content kept and our temp dir removed; replaced as a whole with --overwrite."""
    from safetensors.torch import load_file

    import converters.runtime.staging as staging

    if not renameat2:
        monkeypatch.setattr(staging, "_renameat2", lambda *a: False)
    publish = staging.Staging._publish

    def racing_publish(self):
        self.dst.mkdir()
        (self.dst / "theirs.txt").write_text("the other conversion's output")
        publish(self)

    monkeypatch.setattr(staging.Staging, "_publish", racing_publish)
    parent = tmp_path / "out"
    dst = parent / "ckpt"
    with pytest.raises(CheckpointError) as info:
        convert(sources["hf"], dst, to=to, workers=1)
    assert str(dst) in str(info.value) and "--overwrite" in str(info.value)
    assert sorted(p.name for p in parent.iterdir()) == ["ckpt"], "temp dir left behind"
    assert sorted(p.name for p in dst.iterdir()) == ["theirs.txt"]

    shutil.rmtree(dst)
    convert(sources["hf"], dst, to=to, workers=1, overwrite=True)
    assert sorted(p.name for p in parent.iterdir()) == ["ckpt"], "temp/old dirs left behind"
    assert not (dst / "theirs.txt").exists()
    if to == "hf":
        original = load_file(str(Path(sources["hf"]) / "model.safetensors"))
        got = load_file(str(dst / "model.safetensors"))
        assert all(torch.equal(got[k], original[k]) for k in original)
