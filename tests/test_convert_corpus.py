"""One corpus of damaged and hostile checkpoints, refused the same way by both conversion paths.

Every case starts from a clean checkpoint (a transformers model, converted by our writers into a
sharded HF directory, legacy and torch_dist Megatron checkpoints, and a Megatron-Bridge folder)
and breaks one thing: safetensors headers (overlapping, negative or short offsets, a header that is
not an object, unknown dtypes, duplicate keys, trailing or missing bytes), the index (entries
leading out of the directory, naming missing or wrong shards, unlisted tensors, not JSON), the
torch_dist ``metadata.json`` and ``.metadata``, Megatron ``args`` (a pickled payload, a non-integer
size) and Megatron-Bridge's ``run_config.yaml`` (an alias bomb, a Python tag, a non-string model id).

Each is converted through the copy path and the torch path (``PMZ_COPY_PATH=1`` / ``0``), to HF and
to Megatron: the same one-line refusal on both (the same text), naming the damaged file and the
tensor or entry; nothing written beside the destination, the source untouched, and with
``--overwrite`` an existing destination kept as it was. The CLI says it in one line with exit 1.
For safetensors damage the safetensors library itself is the reference: it refuses every
damaged file too (so the refusal is the format's rule, not ours).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from converters import convert
from converters.cli import main
from models.common.errors import CheckpointError
from tests.cases import snapshot, write_hf_model

ROOT = Path(__file__).resolve().parent.parent
EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
LN0 = "model.layers.0.input_layernorm.weight"
LN1 = "model.layers.1.input_layernorm.weight"


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=False)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpus_src")
    hf = write_hf_model(root, "hf", _config(), seed=5)
    convert(hf, root / "sharded", to="hf", max_shard_size="20KB", workers=1)
    assert len(list((root / "sharded").glob("model-*.safetensors"))) >= 3
    convert(hf, root / "legacy", to="megatron", tp=2, workers=1)
    convert(hf, root / "dist", to="megatron-dist", tp=2, workers=1)
    # Megatron-Bridge: torch_dist without args, described by the HF directory run_config.yaml names
    bridge = root / "bridge"
    it = bridge / "iter_0000010"
    shutil.copytree(root / "dist" / "release", it)
    (it / "common.pt").unlink()
    (bridge / "latest_checkpointed_iteration.txt").write_text("10")
    (it / "run_config.yaml").write_text(f"model:\n  _target_: megatron.bridge.models.llama.LlamaModelProvider\n"
                                        f"  hf_model_id: {hf}\n")
    return {"hf": hf, "sharded": root / "sharded", "legacy": root / "legacy", "dist": root / "dist",
            "bridge": bridge}


# ------------------------------------------------------------------------------------------- damage


def read_st(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(path: Path, header, data: bytes, *, text: str | None = None) -> None:
    """A safetensors file with ``header`` (or raw header ``text``) before the unchanged tensor bytes."""
    head = (text if text is not None else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def edit_header(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(src: Path) -> None:
        f = src / "model.safetensors"
        header, data = read_st(f)
        fn(header)
        write_st(f, header, data)
    return damage


def header_text(text: str) -> Callable[[Path], None]:
    def damage(src: Path) -> None:
        f = src / "model.safetensors"
        _, data = read_st(f)
        write_st(f, None, data, text=text)
    return damage


def overlap(h: dict) -> None:
    h[LN1]["data_offsets"] = list(h[LN0]["data_offsets"])  # same shape: one tensor read as two


def negative(h: dict) -> None:
    a, b = h[LN1]["data_offsets"]
    h[LN1]["data_offsets"] = [a - b - 4, b]


def duplicate_keys(src: Path) -> None:
    f = src / "model.safetensors"
    header, data = read_st(f)
    text = json.dumps(header)
    entry = json.dumps(header[LN0])
    write_st(f, None, data, text=text[:-1] + f', "{LN0}": {entry}}}')


def trailing(src: Path) -> None:
    with open(src / "model.safetensors", "ab") as f:
        f.write(b"\0" * 16)


def truncated(src: Path) -> None:
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-16])


def header_past_end(src: Path) -> None:
    f = src / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw))
    f.write_bytes(bytes(raw))


def edit_index(fn: Callable[[dict, Path], None]) -> Callable[[Path], None]:
    def damage(src: Path) -> None:
        f = src / "model.safetensors.index.json"
        index = json.loads(f.read_text())
        fn(index["weight_map"], src)
        f.write_text(json.dumps(index))
    return damage


def outside_real_file(wm: dict, src: Path) -> None:
    """An entry leading to a real safetensors file outside the source (one that even holds the tensor)."""
    outside = src.parent / "elsewhere"
    outside.mkdir()
    shutil.copy(src / wm[EMBED], outside / wm[EMBED])
    wm[EMBED] = f"../elsewhere/{wm[EMBED]}"


def wrong_shard(wm: dict, src: Path) -> None:
    wm[LN0] = next(f for f in sorted(set(wm.values())) if f != wm[LN0])


def edit_pt(path: Path, fn) -> None:
    data = torch.load(path, map_location="cpu", weights_only=False)
    fn(data)
    torch.save(data, path)


class RunsCode:
    """Pickles as a call to ``func(*args)``: what a malicious checkpoint would contain."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def legacy_files(src: Path) -> list[Path]:
    return sorted(src.rglob("model_optim_rng.pt"))


def args_payload(src: Path) -> None:
    marker = src.parent / "pwned"
    for f in legacy_files(src):
        edit_pt(f, lambda d: d.__setitem__("args", RunsCode(os.system, f"touch {marker}")))


def args_string_tp(src: Path) -> None:
    for f in legacy_files(src):
        edit_pt(f, lambda d: setattr(d["args"], "tensor_model_parallel_size", "2"))


def dist_dir(src: Path) -> Path:
    return next(p.parent for p in src.rglob("metadata.json"))


def metadata_json(text: str) -> Callable[[Path], None]:
    return lambda src: (dist_dir(src) / "metadata.json").write_text(text)


def storage_outside(src: Path) -> None:
    """A chunk whose storage entry names a file outside the folder."""
    f = dist_dir(src) / ".metadata"
    md = pickle.loads(f.read_bytes())
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn.startswith("decoder."))
    info.relative_path = "../../../" + info.relative_path
    f.write_bytes(pickle.dumps(md))


def run_config(text: str) -> Callable[[Path], None]:
    return lambda src: (next(src.rglob("run_config.yaml"))).write_text(text)


BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)) + \
    "model:\n  hf_model_id: *i\n"


@dataclass(frozen=True)
class Case:
    name: str
    source: str  # key of the clean fixture
    damage: Callable[[Path], None]
    named: tuple[str, ...]  # what the one-line refusal must name (besides the damaged file)
    file: str  # the damaged file, relative to the source
    library_refuses: bool = False  # safetensors damage: safetensors' own reader must refuse it too


CORPUS = [
    Case("st-overlap", "hf", edit_header(overlap), ("overlaps", LN0, LN1), "model.safetensors", True),
    Case("st-negative-offset", "hf", edit_header(negative), (LN1, "data_offsets"), "model.safetensors", True),
    Case("st-header-list", "hf", header_text("[1, 2, 3]"), ("not an object",), "model.safetensors", True),
    Case("st-header-not-json", "hf", header_text('{"a": '), ("JSON",), "model.safetensors", True),
    Case("st-unknown-dtype", "hf", edit_header(lambda h: h[NORM].update(dtype="F17")), (NORM, "F17"),
         "model.safetensors", True),
    Case("st-shape-vs-bytes", "hf", edit_header(lambda h: h[NORM].update(shape=[31])), (NORM, "(31,)"),
         "model.safetensors", True),
    Case("st-offsets-not-ints", "hf", edit_header(lambda h: h[NORM].update(data_offsets=[0.5, 1])),
         (NORM, "data_offsets"), "model.safetensors", True),
    Case("st-entry-not-object", "hf", edit_header(lambda h: h.__setitem__(NORM, [1, 2])), (NORM,),
         "model.safetensors", True),
    Case("st-duplicate-keys", "hf", duplicate_keys, ("duplicate", LN0), "model.safetensors"),
    Case("st-trailing-bytes", "hf", trailing, ("after the last tensor",), "model.safetensors", True),
    Case("st-truncated", "hf", truncated, ("truncated",), "model.safetensors", True),
    Case("st-header-past-end", "hf", header_past_end, ("header length",), "model.safetensors", True),
    Case("index-parent-path", "sharded", edit_index(lambda wm, s: wm.__setitem__(EMBED, "../../../etc/passwd")),
         (EMBED, "../../../etc/passwd"), "model.safetensors.index.json"),
    Case("index-absolute-path", "sharded", edit_index(lambda wm, s: wm.__setitem__(EMBED, "/etc/passwd")),
         (EMBED, "/etc/passwd"), "model.safetensors.index.json"),
    Case("index-dotdot", "sharded", edit_index(lambda wm, s: wm.__setitem__(EMBED, "..")), (EMBED, "'..'"),
         "model.safetensors.index.json"),
    Case("index-outside-real-file", "sharded", edit_index(outside_real_file), (EMBED, "../elsewhere/"),
         "model.safetensors.index.json"),
    Case("index-missing-shard", "sharded",
         edit_index(lambda wm, s: wm.__setitem__(EMBED, "model-00099-of-00099.safetensors")),
         (EMBED, "model-00099-of-00099.safetensors"), "model.safetensors.index.json"),
    Case("index-wrong-shard", "sharded", edit_index(wrong_shard), (LN0,), "model.safetensors.index.json"),
    Case("index-unlisted-tensor", "sharded", edit_index(lambda wm, s: wm.pop(LN0)), (LN0, "no entry"),
         "model.safetensors.index.json"),
    Case("index-not-json", "sharded", lambda s: (s / "model.safetensors.index.json").write_text("{oops"),
         ("JSON",), "model.safetensors.index.json"),
    Case("index-a-list", "sharded", lambda s: (s / "model.safetensors.index.json").write_text("[]"),
         ("weight_map",), "model.safetensors.index.json"),
    Case("dist-backend-zarr", "dist", metadata_json('{"sharded_backend": "zarr"}'), ("zarr", "torch_dist"),
         "release/metadata.json"),
    Case("dist-metadata-json-garbage", "dist", metadata_json("\x00garbage"), ("JSON",), "release/metadata.json"),
    Case("dist-metadata-json-list", "dist", metadata_json("[1]"), ("sharded_backend",), "release/metadata.json"),
    Case("dist-storage-outside", "dist", storage_outside, ("../../../", "decoder."), "release/.metadata"),
    Case("legacy-args-payload", "legacy", args_payload, ("'args'", "system"),
         "release/mp_rank_00/model_optim_rng.pt"),
    Case("legacy-args-string-size", "legacy", args_string_tp, ("tensor_model_parallel_size", "'2'"),
         "release/mp_rank_00/model_optim_rng.pt"),
    Case("bridge-yaml-alias-bomb", "bridge", run_config(BOMB), ("alias",), "iter_0000010/run_config.yaml"),
    Case("bridge-yaml-python-tag", "bridge",
         run_config("model:\n  hf_model_id: !!python/object/apply:os.system ['touch pwned']\n"), ("python",),
         "iter_0000010/run_config.yaml"),
    Case("bridge-yaml-model-id-list", "bridge", run_config("model:\n  hf_model_id: [1, 2]\n"),
         ("model.hf_model_id", "list"), "iter_0000010/run_config.yaml"),
]


def _damaged(clean: dict[str, Path], case: Case, tmp_path: Path) -> Path:
    src = tmp_path / "src" / case.source
    shutil.copytree(clean[case.source], src)
    case.damage(src)
    return src


def _refusal(src: Path, dst: Path, to: str, path: str, monkeypatch, overwrite: bool = False) -> str:
    monkeypatch.setenv("PMZ_COPY_PATH", path)
    with pytest.raises(CheckpointError) as info:
        convert(src, dst, to=to, workers=1, overwrite=overwrite)
    return str(info.value)


@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_both_paths_refuse_the_same_way(clean, tmp_path, monkeypatch, capsys, case):
    src = _damaged(clean, case, tmp_path)
    damaged = src / case.file
    assert damaged.is_file()
    if case.library_refuses:
        from safetensors import safe_open

        with pytest.raises(Exception):  # noqa: B017 - the library raises its own error types
            with safe_open(str(damaged), "pt") as f:
                [f.get_tensor(k) for k in f.keys()]
    before = snapshot(src)
    out = tmp_path / "out"
    out.mkdir()
    for to in ("hf", "megatron"):
        dst = out / to
        messages = {path: _refusal(src, dst, to, path, monkeypatch) for path in ("1", "0")}
        assert messages["1"] == messages["0"], f"the paths refuse differently:\n{messages}"
        msg = messages["1"]
        assert "\n" not in msg and str(damaged) in msg, f"not one line naming {damaged}: {msg}"
        for n in case.named:
            assert n in msg, f"the refusal does not name {n!r}: {msg}"
        assert list(out.iterdir()) == [], "a refused conversion left something behind"
        assert snapshot(src) == before, "the source changed"

        # --overwrite: an existing destination stays exactly as it was
        shutil.copytree(clean["hf"], dst)
        kept = snapshot(dst)
        for path in ("1", "0"):
            assert _refusal(src, dst, to, path, monkeypatch, overwrite=True) == msg
            assert snapshot(dst) == kept and sorted(p.name for p in out.iterdir()) == [to]
        shutil.rmtree(dst)

    monkeypatch.delenv("PMZ_COPY_PATH")
    capsys.readouterr()
    rc = main(["convert", str(src), str(out / "cli"), "--to", "hf", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and err.splitlines() == [f"pmz convert: error: {' '.join(msg.split())}"], err
    assert list(out.iterdir()) == [] and snapshot(src) == before
    assert not (src.parent / "pwned").exists() and not (tmp_path / "pwned").exists(), "a payload ran"


@pytest.mark.parametrize("name", ["hf", "sharded", "legacy", "dist", "bridge"])
def test_clean_sources_convert_identically_on_both_paths(clean, tmp_path, monkeypatch, name):
    """The control: the undamaged sources convert, with the same bytes on both paths (so the
    corpus fails because of its damage)."""
    outs = {}
    for path in ("1", "0"):
        monkeypatch.setenv("PMZ_COPY_PATH", path)
        outs[path] = convert(clean[name], tmp_path / f"out{path}", to="hf", workers=1)
    a, b = ({p.name: p.read_bytes() for p in o.iterdir() if p.suffix == ".safetensors"} for o in outs.values())
    assert a and a == b


def test_yaml_bomb_ends_quickly_under_a_memory_cap(clean, tmp_path):
    """The 10^9-item alias bomb as a user meets it: ``pmz inspect`` in a process capped at 4 GiB of
    address space ends in one line naming run_config.yaml (it used to run out of memory)."""
    src = _damaged(clean, CORPUS[[c.name for c in CORPUS].index("bridge-yaml-alias-bomb")], tmp_path)
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
            "from converters.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", code, "inspect", str(src)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "run_config.yaml" in lines[0] and "alias" in lines[0], lines
