"""Random damage to small checkpoints' safetensors headers, index and torch_dist metadata.json
(hypothesis, a bounded and derandomized number of examples): every conversion either succeeds with
the right bytes or refuses with an error naming a file of the source -- never another exception
(the CLI would print a traceback), never success with wrong bytes. Each example runs through the
copy path and the torch path (``PMZ_COPY_PATH=1`` / ``0``), which must give the same outcome.

What "the right bytes" are comes from outside the code under test:
  * safetensors headers: the safetensors library. Where it refuses the mutated file, pmz must
    refuse too; where pmz succeeds, its output holds exactly the tensors the library reads from the
    mutated file (a mutation can make another valid file: two tensors' offsets swapped, say).
  * the index and metadata.json: the clean conversion's bytes (no valid edit of them changes a
    tensor, so success must reproduce them exactly).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from converters import convert
from tests.cases import write_hf_model

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
                         st.sampled_from(["F32", "F16", "BF16", "I32", "U8", "F8_E4M3", "torch_dist", "zarr"]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=16,
                       tie_word_embeddings=False)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fuzz_src")
    hf = write_hf_model(root, "hf", _config(), seed=7)
    convert(hf, root / "sharded", to="hf", max_shard_size="4KB", workers=1)
    assert len(list((root / "sharded").glob("model-*.safetensors"))) >= 3
    convert(hf, root / "dist", to="megatron-dist", tp=1, workers=1)
    out = {}
    for name in ("hf", "sharded", "dist"):
        converted = convert(root / name, root / f"{name}-out", to="hf", workers=1)
        out[name] = _files(converted)
    return {"root": root, "out": out}


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _outcome(src: Path, work: Path) -> dict[str, tuple]:
    """("ok", files) or ("refused", message) for each path; anything but the errors the CLI reports
    in one line (ValueError and its CheckpointError, OSError) propagates and fails the test."""
    outcomes = {}
    for path in ("1", "0"):
        os.environ["PMZ_COPY_PATH"] = path
        dst = work / f"out{path}"
        try:
            convert(src, dst, to="hf", workers=1)
            outcomes[path] = ("ok", _files(dst))
        except (ValueError, OSError) as exc:
            msg = str(exc)
            assert str(src) in msg, f"path {path}: the error names no file of the source: {msg}"
            assert not dst.exists() and not list(work.glob(".out*")), "a refused conversion left output behind"
            outcomes[path] = ("refused", msg)
        finally:
            del os.environ["PMZ_COPY_PATH"]
    assert outcomes["1"] == outcomes["0"], f"the paths disagree: {outcomes['1'][0]} vs {outcomes['0'][0]}"
    return outcomes["1"]


class _Work:
    """A temp dir holding a copy of a clean source, removed afterwards."""

    def __init__(self, source: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pmz-fuzz-"))
        self.src = self.dir / "src"
        shutil.copytree(source, self.src)

    def __enter__(self) -> "_Work":
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# ------------------------------------------------------------------------------------- safetensors headers


@st.composite
def header_mutations(draw):
    """(kind, parameters) of one change to a safetensors header: bytes flipped, or a JSON edit."""
    kind = draw(st.sampled_from(["bytes", "field", "swap", "delete", "rename", "metadata", "whole"]))
    if kind == "bytes":
        return kind, draw(st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=4))
    if kind == "field":
        value = draw(st.one_of(json_values, st.lists(st.integers(-2, 1 << 20), min_size=0, max_size=3)))
        return kind, (draw(st.integers(0, 1 << 10)), draw(st.sampled_from(["dtype", "shape", "data_offsets"])), value)
    if kind in ("swap", "rename"):
        return kind, (draw(st.integers(0, 1 << 10)), draw(st.integers(0, 1 << 10)))
    if kind == "delete":
        return kind, draw(st.integers(0, 1 << 10))
    return kind, draw(json_values)


def _mutate_header(path: Path, mutation) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    kind, params = mutation
    if kind == "bytes":
        data = bytearray(raw)
        for pos, value in params:
            data[pos % (8 + n)] = value
        path.write_bytes(bytes(data))
        return
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    names = sorted(k for k in header if k != "__metadata__")
    if kind == "field":
        i, field, value = params
        header[names[i % len(names)]][field] = value
    elif kind == "swap":
        a, b = names[params[0] % len(names)], names[params[1] % len(names)]
        header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    elif kind == "rename":
        a, b = names[params[0] % len(names)], names[params[1] % len(names)]
        header[b + ".x" if a == b else b] = header.pop(a)
    elif kind == "delete":
        del header[names[params % len(names)]]
    elif kind == "metadata":
        header["__metadata__"] = params
    else:
        header = params
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _library_reads(path: Path) -> dict[str, torch.Tensor] | None:
    """The tensors safetensors' own reader gives for the file, None where it refuses it."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception:  # its own error types (SafetensorError, ValueError, ...)
        return None


@FUZZ
@given(mutation=header_mutations())
def test_fuzzed_safetensors_headers(clean, mutation):
    from safetensors.torch import load

    with _Work(clean["root"] / "hf") as work:
        _mutate_header(work.src / "model.safetensors", mutation)
        expected = _library_reads(work.src / "model.safetensors")
        kind, result = _outcome(work.src, work.dir)
        event(f"{mutation[0]}: {kind}, library {'refuses' if expected is None else 'reads it'}")
        if expected is None:
            assert kind == "refused", "pmz converted a file the safetensors library refuses"
        if kind == "ok":
            got = {k: v for name, data in result.items() if name.endswith(".safetensors")
                   for k, v in load(data).items()}
            assert got.keys() == expected.keys()
            for name, tensor in got.items():
                assert torch.equal(tensor, expected[name].to(tensor.dtype)), f"{name} is not what the file holds"


# -------------------------------------------------------------------------------- index and metadata.json


@st.composite
def index_mutations(draw):
    kind = draw(st.sampled_from(["entry", "delete", "add", "whole", "bytes", "metadata"]))
    targets = st.one_of(st.sampled_from(["../model-00001-of-00009.safetensors", "/etc/passwd", "", ".", "..",
                                         "model.safetensors", "config.json", "model.safetensors.index.json"]),
                        st.integers(0, 64), st.text(max_size=20))
    if kind == "entry":
        return kind, (draw(st.integers(0, 1 << 10)), draw(targets))
    if kind == "delete":
        return kind, draw(st.integers(0, 1 << 10))
    if kind == "add":
        return kind, (draw(st.text(max_size=30)), draw(targets))
    if kind == "bytes":
        return kind, draw(st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=4))
    return kind, draw(json_values)


def _mutate_index(path: Path, mutation) -> None:
    kind, params = mutation
    if kind == "bytes":
        data = bytearray(path.read_bytes())
        for pos, value in params:
            data[pos % len(data)] = value
        path.write_bytes(bytes(data))
        return
    index = json.loads(path.read_text())
    files = sorted(set(index["weight_map"].values()))
    names = sorted(index["weight_map"])
    if kind == "entry":
        i, target = params
        index["weight_map"][names[i % len(names)]] = files[target % len(files)] if isinstance(target, int) else target
    elif kind == "delete":
        del index["weight_map"][names[params % len(names)]]
    elif kind == "add":
        name, target = params
        index["weight_map"][name] = files[target % len(files)] if isinstance(target, int) else target
    elif kind == "metadata":
        index["metadata"] = params
    else:
        index = params
    path.write_text(json.dumps(index))


@FUZZ
@given(mutation=index_mutations())
def test_fuzzed_safetensors_index(clean, mutation):
    with _Work(clean["root"] / "sharded") as work:
        _mutate_index(work.src / "model.safetensors.index.json", mutation)
        kind, result = _outcome(work.src, work.dir)
        event(f"{mutation[0]}: {kind}")
        if kind == "ok":
            assert result == clean["out"]["sharded"], "a converted index edit changed the output"


@FUZZ
@given(mutation=st.one_of(st.tuples(st.just("whole"), json_values),
                          st.tuples(st.just("backend"), json_values),
                          st.tuples(st.just("bytes"), st.lists(st.tuples(st.integers(0, 1 << 10), st.integers(0, 255)),
                                                               min_size=1, max_size=4))))
def test_fuzzed_torch_dist_metadata_json(clean, mutation):
    with _Work(clean["root"] / "dist") as work:
        path = next(work.src.rglob("metadata.json"))
        kind, params = mutation
        if kind == "bytes":
            data = bytearray(path.read_bytes())
            for pos, value in params:
                data[pos % len(data)] = value
            path.write_bytes(bytes(data))
        else:
            meta = json.loads(path.read_text())
            meta = params if kind == "whole" else {**meta, "sharded_backend": params}
            path.write_text(json.dumps(meta))
        outcome, result = _outcome(work.src, work.dir)
        event(f"{kind}: {outcome}")
        if outcome == "ok":
            assert result == clean["out"]["dist"], "a converted metadata.json edit changed the output"
