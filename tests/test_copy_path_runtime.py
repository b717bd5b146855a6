"""The copy path's process-level settings (issue 40, session 17): what they change and that they are undone.

- The cyclic garbage collector is paused while the copy path runs (``engine._without_cyclic_gc``) and its state
  restored afterwards, on success and on failure, and left off when the caller had it off.
- numpy, which the grouped-GEMM transposes use for copies only, is imported on the planning thread with
  OpenBLAS held to one thread (``transpose.preload_numpy``): no BLAS thread pool beside the copy threads, and
  ``OPENBLAS_NUM_THREADS`` back as it was (checked in a fresh interpreter, where numpy is not yet imported).
Outputs are compared with the torch path byte for byte elsewhere (``test_copy_path_moe.py`` for GroupedMLP).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from converters.engine import convert
from models.common.errors import CheckpointError
from tests.test_startup_imports import _bench_startup

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("runtime") / "hf"
    _bench_startup().write_tiny_hf(path)
    return path


def test_gc_paused_during_copy_path_and_restored(tiny_hf, tmp_path, monkeypatch):
    """During the copy path's writer gc is off; after convert it is on again (and the output exists)."""
    import converters.copy_path.hf as hf_writer

    seen = []
    original = hf_writer.write_hf_by_copy

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(hf_writer, "write_hf_by_copy", spy)
    assert gc.isenabled()
    out = convert(tiny_hf, tmp_path / "out", to="hf")
    assert seen == [False]  # the copy path ran, with the collector paused
    assert gc.isenabled()
    assert any(Path(out).glob("*.safetensors"))


def test_gc_restored_after_failure_and_left_off_when_off(tiny_hf, tmp_path, monkeypatch):
    import converters.copy_path.hf as hf_writer

    def fail(*args, **kwargs):
        raise CheckpointError("made to fail")

    monkeypatch.setattr(hf_writer, "write_hf_by_copy", fail)
    with pytest.raises(CheckpointError, match="made to fail"):
        convert(tiny_hf, tmp_path / "out", to="hf")
    assert gc.isenabled()
    assert not (tmp_path / "out").exists()  # nothing left behind
    monkeypatch.undo()
    gc.disable()
    try:
        convert(tiny_hf, tmp_path / "out2", to="hf")
        assert not gc.isenabled()  # the caller's choice is kept
    finally:
        gc.enable()


def test_preload_numpy_pins_openblas_for_the_import_only():
    """A fresh interpreter: numpy imported by ``preload_numpy`` starts no BLAS threads, and the variable is gone
    again; with the variable set by the user, it is left as it was."""
    code = ("import os, sys\n"
            "from converters.copy_path.transpose import preload_numpy\n"
            "assert 'numpy' not in sys.modules\n"
            "preload_numpy()\n"
            "assert 'numpy' in sys.modules\n"
            "print(len(os.listdir('/proc/self/task')), os.environ.get('OPENBLAS_NUM_THREADS'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["1", "None"]
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "OPENBLAS_NUM_THREADS": "3"},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[1] == "3"


def test_pickle_writer_read_back_by_torch():
    """``pickles.dumps`` (the copy path's Megatron pickles: a writer per node type, tensors pre-rendered by
    ``pickles.tensor``) read back by ``torch.load`` (an independent unpickler) as the objects ``torch.save``
    would have written: tensors of several dtypes and ranks, a namespace of mixed values, nested containers,
    an OrderedDict (a dict subclass: the writers' isinstance fallback, read back as a dict); ``tensor`` against
    ``tensor_node``."""
    import argparse
    import io
    from collections import OrderedDict

    import torch

    from converters.formats import pickles as pw
    from converters.formats.torch_zip import archive_bytes

    shapes = [((3, 4), torch.float32, "F32"), ((5,), torch.int64, "I64"), ((2, 1, 3), torch.bfloat16, "BF16"),
              ((), torch.float16, "F16"), ((300, 1), torch.uint8, "U8")]
    fields = {"hidden_size": 1024, "big": 1 << 40, "neg": -3, "neg_big": -(1 << 35), "lr": 1.5e-4,
              "name": "m\u00e9gatron", "flag": True, "off": False, "none": None, "sizes": [1, 256, 65536],
              "pair": (7, "x"), "many": (1, 2, 3, 4, 5), "empty": (), "raw": b"\x00\xff"}
    ref = {f"t{i}": (torch.arange(max(1, torch.Size(shape).numel())) % 100).to(dtype).reshape(shape)
           for i, (shape, dtype, _) in enumerate(shapes)}
    ours = {f"t{i}": pw.tensor(str(i), tag, shape) for i, (shape, _, tag) in enumerate(shapes)}
    extra = {"iteration": 70000, "nested": {"a": [], "b": {"c": [1.0, None]}}, "od": OrderedDict(x=1)}
    data = archive_bytes(pw.dumps({**ours, "args": pw.namespace(fields), **extra}),
                         [t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in ref.values()])
    got = torch.load(io.BytesIO(data), weights_only=False)
    for key, tensor in ref.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape and torch.equal(got[key], tensor)
    assert isinstance(got["args"], argparse.Namespace) and vars(got["args"]) == fields
    assert {k: got[k] for k in extra} == extra  # a dict subclass is written as a plain dict, as before
    for i, (shape, _, tag) in enumerate(shapes):
        assert pw.dumps(pw.tensor(str(i), tag, shape)) == pw.dumps(pw.tensor_node(str(i), tag, shape))
