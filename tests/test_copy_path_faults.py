"""Hostile input and faults beside the copy path's newer writers and readers: vLLM ``sharded_state`` as a target
(``copy_path/vllm.py``) and a source (``copy_path/vllm_source.py``), mixture-of-experts Megatron checkpoints --
legacy with expert parallelism, torch_dist, grouped-GEMM ``GroupedMLP`` -- as targets and sources
(``copy_path/megatron.py``, ``megatron_moe.py``, ``grouped_moe.py``), and MoE -> vLLM.

One tiny Qwen2-MoE (tests/workers_moe ``shared``: a shared expert, a dense layer, 8 experts) and its checkpoints
written by pmz: legacy TP2 x EP2, torch_dist TP2 x EP2 (per-layer expert tensors), GroupedMLP TP2 x EP2, vLLM TP2;
and a Qwen3-MoE with every layer sparse (tests/test_copy_path_moe), whose torch_dist experts are stacked
``[L, E, ...]``.
Each ``CASES`` conversion pairs a damaged source reader with a new writer. For every one:

* a damaged source -- a truncated file, a tensor (one expert, one TP shard) of the wrong shape, a missing
  rank/data file, a missing expert -- is refused before anything is written: exit 1, one line on stderr naming the
  file and the tensor or the numbers, the same line on the torch path (one reader validates each format for both),
  nothing at or beside the destination (no temp dir, no parent created for it);
* SIGINT (and SIGTERM, SIGKILL for some) while the workers are mid-write (tests/test_convert_faults' ``HeldRun``:
  a ``sitecustomize`` hook holds each worker task after the files were laid out): exit 130 / 143 and one line,
  nothing left, no worker thread running; SIGKILL's stale temp dir removed by the next run;
* a full disk: a file size limit (EFBIG, in the main thread laying files out) and ENOSPC from ``pwrite`` /
  ``pwritev`` in the worker threads: exit 1, one line naming the destination's file and the errno text, nothing
  left, no thread left;
* after each, the same command into the same destination (the source repaired) succeeds on the copy path and
  writes exactly the files of an undisturbed run.

Cost: 70-90 s on 2 busy cores, 42 tests (the two models ~10 s; 25 damaged sources in-process, each also on the
torch path and rerun; 12 ``pmz`` subprocesses, held or size-limited, ~3-5 s each). In-process conversions of the
legacy rank files take ~3 s here against ~0.6 s in a fresh ``pmz``: garbage collections over the heap transformers
and torch leave in the test process, not the converter.
"""

from __future__ import annotations

import errno
import glob
import os
import pickle
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch

from converters.cli import main as pmz
from converters.engine import convert
from tests.cases import snapshot
from tests.test_convert_faults import (  # noqa: F401 (held_runs: a fixture)
    FINISH_S,
    HeldRun,
    _env,
    _file_size_limit,
    alive,
    held_runs,
    linux_only,
    one_error_line,
    temp_dirs,
    wait_for,
)
from tests.test_convert_faults import pmz as pmz_process

# id -> (source, pmz convert options): every new reader and writer of the copy path at least once
CASES = {
    "legacy-ep-to-vllm": ("legacy", ["--to", "vllm", "--tp", "2"]),
    "vllm-to-legacy-ep": ("vllm", ["--to", "megatron", "--tp", "2", "--ep", "2"]),
    "grouped-to-dist": ("grouped", ["--to", "megatron-dist"]),
    "dist-to-grouped": ("dist", ["--to", "megatron", "--moe-grouped-gemm"]),
    "hf-to-vllm": ("hf", ["--to", "vllm", "--tp", "2"]),
    "stacked-dist-to-vllm": ("stacked", ["--to", "vllm", "--tp", "2"]),
    "qwen3-hf-to-stacked-dist": ("qwen3", ["--to", "megatron-dist", "--tp", "2", "--ep", "2"]),
}
WRITERS = ["legacy-ep-to-vllm", "vllm-to-legacy-ep", "grouped-to-dist", "dist-to-grouped"]  # signals, EFBIG
# name -> (HF model, target, layout): pmz's checkpoints of the HF models
SOURCES = {"legacy": ("hf", "megatron", dict(tp=2, ep=2)), "dist": ("hf", "megatron-dist", dict(tp=2, ep=2)),
           "grouped": ("hf", "megatron", dict(tp=2, ep=2, moe_grouped_gemm=True)), "vllm": ("hf", "vllm", dict(tp=2)),
           "stacked": ("qwen3", "megatron-dist", dict(tp=2, ep=2))}


class Moe:
    """The checkpoints (``paths``) and each case's undisturbed output (``reference``, made once)."""

    def __init__(self, root: Path, paths: dict[str, Path]) -> None:
        self.root, self.paths, self._refs = root, paths, {}

    def reference(self, case: str) -> dict[str, str]:
        if case not in self._refs:
            name, argv = CASES[case]
            out = self.root / "reference" / case
            assert pmz(["convert", str(self.paths[name]), str(out), *argv, "--quiet"]) == 0
            self._refs[case] = snapshot(out)
        return self._refs[case]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Moe:
    from tests.test_copy_path_moe import write_qwen3_moe
    from tests.workers_moe import write_moe_model

    root = tmp_path_factory.mktemp("copy_faults")
    paths = {"hf": Path(write_moe_model(root, "shared", seed=1)), "qwen3": Path(write_qwen3_moe(root / "qwen3"))}
    for name, (model, to, layout) in SOURCES.items():
        paths[name] = convert(paths[model], root / name, to=to, workers=1, **layout)
    return Moe(root, paths)


def _command(moe: Moe, case: str, src: Path, dst: Path) -> list[str]:
    return ["convert", str(src), str(dst), *CASES[case][1], "--quiet", "--workers", "2"]


def _rerun_succeeds(moe: Moe, case: str, src: Path, dst: Path, taken: list[bool], capsys) -> None:
    """The same command into the same destination succeeds, on the copy path, with an undisturbed run's files."""
    assert pmz(_command(moe, case, src, dst)) == 0, capsys.readouterr().err
    assert taken[-1] is True, "the rerun did not take the copy path"
    assert snapshot(dst) == moe.reference(case)
    assert sorted(p.name for p in dst.parent.iterdir()) == [dst.name], "a temp dir is left beside the output"


def _nothing_left(out: Path) -> None:
    assert not out.exists(), f"left behind: {sorted(p.name for p in out.iterdir())}"


# ---------------------------------------------------------------------------------------------- damaged sources


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size * 2 // 3)


def _rank_files(pattern: str, edit):
    """Damage: ``edit(state dict)`` on every legacy rank file matching ``pattern``."""
    def damage(src: Path) -> None:
        for name in sorted(glob.glob(str(src / pattern))):
            data = torch.load(name, weights_only=False)  # our own test file
            edit(data["model"])
            torch.save(data, name)

    return damage


def _safetensors(name: str, edit):
    def damage(src: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(src / name))
        edit(tensors)
        save_file(tensors, str(src / name), metadata={"format": "pt"})

    return damage


def _dist_chunks(key: str, edit):
    """Damage: ``edit(chunk list)`` of ``key`` in a torch_dist checkpoint's ``.metadata``."""
    def damage(src: Path) -> None:
        path = src / "release" / ".metadata"
        md = pickle.loads(path.read_bytes())  # our own test file
        edit(md.state_dict_metadata[key].chunks)
        path.write_bytes(pickle.dumps(md))

    return damage


def _shrink_chunk(chunks: list, i: int = 5) -> None:
    chunks[i] = type(chunks[i])(offsets=chunks[i].offsets, sizes=torch.Size([*chunks[i].sizes[:-1], 31]))


def _drop_chunk(offsets: tuple):
    return lambda chunks: chunks.remove(next(c for c in chunks if tuple(c.offsets) == offsets))


def _set(key: str, value):
    return lambda state: state.__setitem__(key, value)


def _slice(key: str, index):
    return lambda state: state.__setitem__(key, state[key][index].contiguous())


EXPERT = "decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"
GROUPED_STRAY = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
DIST_FC1 = "decoder.layers.0.mlp.experts.experts.linear_fc1.weight"
DIST_FC2 = "decoder.layers.2.mlp.experts.experts.linear_fc2.weight"
STACKED_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
STACKED_FC2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
VLLM = "model.layers.0.mlp.experts.routed_experts."
HF_EXPERTS = "model.layers.{}.mlp.experts.{}.{}_proj.weight"

# source -> {damage: (edit of a copy of the source, fragments of the one-line error)}
DAMAGE = {
    "legacy": {
        "truncated": (lambda s: _truncate(s / "release/mp_rank_01_001/model_optim_rng.pt"),
                      ["mp_rank_01_001/model_optim_rng.pt", "truncated"]),
        "wrong-shape": (_rank_files("release/mp_rank_01_001/*.pt", _set(EXPERT, torch.zeros(33, 64))),
                        [EXPERT, "mp_rank_00_001 (32, 64)", "mp_rank_01_001 (33, 64)"]),
        "missing-file": (lambda s: shutil.rmtree(s / "release/mp_rank_01_001"),
                         ["missing rank folder(s) mp_rank_01_001", "tp=2 pp=1 ep=2"]),
        "missing-expert": (_rank_files("release/mp_rank_00_001/*.pt", lambda m: m.pop(
            "decoder.layers.3.mlp.experts.local_experts.3.linear_fc2.weight")),
            ["mp_rank_00_001/model_optim_rng.pt", "missing tensor decoder.layers.3.mlp.experts.local_experts.3."]),
        "wrong-shape-every-tp-rank": (_rank_files("release/mp_rank_*_001/*.pt", _set(EXPERT, torch.zeros(33, 64))),
                                      [EXPERT, "mp_rank_00_001", "(33, 64)", "implies (32, 64)", "tp=2"]),
    },
    "grouped": {
        "truncated": (lambda s: _truncate(s / "release/mp_rank_00_001/model_optim_rng.pt"),
                      ["mp_rank_00_001/model_optim_rng.pt", "truncated"]),
        "wrong-shape": (_rank_files("release/mp_rank_01_000/*.pt", _set("decoder.layers.0.mlp.experts.weight1",
                                                                         torch.zeros(64, 127))),
                        ["decoder.layers.0.mlp.experts.weight1", "mp_rank_01_000 (64, 127)"]),
        "missing-file": (lambda s: os.remove(s / "release/mp_rank_00_001/model_optim_rng.pt"),
                         ["mp_rank_00_001/model_optim_rng.pt: missing rank file"]),
        "missing-expert": (_rank_files("release/mp_rank_01_001/*.pt", lambda m: m.pop(
            "decoder.layers.2.mlp.experts.weight2")), ["mp_rank_01_001", "missing tensor decoder.layers.2.mlp."]),
        "sequential-expert-beside-grouped": (
            _rank_files("release/mp_rank_00_000/*.pt", _set(GROUPED_STRAY, torch.zeros(32, 64))),
            ["mp_rank_00_000/model_optim_rng.pt", f"unused tensor(s) {GROUPED_STRAY}", "two layouts mixed"]),
        "expert-count": (_rank_files("release/mp_rank_*_000/*.pt", _set("decoder.layers.0.mlp.experts.weight2",
                                                                         torch.zeros(60, 64))),
                         ["mp_rank_00_000", "weight2 has shape (60, 64)", "(64, 64)", "4 local experts"]),
    },
    "dist": {
        "truncated": (lambda s: _truncate(s / "release/__1_0.distcp"), ["truncated data file __1_0.distcp"]),
        "wrong-shape": (_dist_chunks(DIST_FC2, _shrink_chunk), [".metadata", DIST_FC2, "16320 of 16384"]),
        "missing-file": (lambda s: os.remove(s / "release/__3_0.distcp"), ["missing data file __3_0.distcp"]),
        "missing-expert": (_dist_chunks(DIST_FC1, lambda c: c.pop(5)), [".metadata", DIST_FC1, "28672 of 32768"]),
    },
    "stacked": {
        "truncated": (lambda s: _truncate(s / "release/__2_0.distcp"), ["truncated data file __2_0.distcp"]),
        "wrong-shape": (_dist_chunks(STACKED_FC2, lambda c: _shrink_chunk(c, 13)),
                        [".metadata", STACKED_FC2, "65472 of 65536"]),
        "missing-expert": (_dist_chunks(STACKED_FC1, _drop_chunk((2, 3, 0, 0))),
                           [".metadata", STACKED_FC1, "126976 of 131072"]),
    },
    "vllm": {
        "truncated": (lambda s: _truncate(s / "model-rank-1-part-0.safetensors"),
                      ["model-rank-1-part-0.safetensors", "truncated", "534808"]),
        "wrong-shape": (_safetensors("model-rank-1-part-0.safetensors", _slice(VLLM + "w2_weight", (..., slice(15)))),
                        ["model-rank-1-part-0.safetensors", "w2_weight", "[8, 64, 15]", "[8, 64, 16]", "rank 1 of 2"]),
        "missing-file": (lambda s: os.remove(s / "model-rank-1-part-0.safetensors"),
                         ["model-rank-1-part-0.safetensors: missing", "tp=2"]),
        "missing-expert": (_safetensors("model-rank-0-part-0.safetensors", _slice(VLLM + "w13_weight", slice(7))),
                           ["model-rank-0-part-0.safetensors", "w13_weight", "[7, 32, 64]", "[8, 32, 64]"]),
    },
    "hf": {
        "truncated": (lambda s: _truncate(s / "model.safetensors"), ["model.safetensors", "truncated"]),
        "wrong-shape": (_safetensors("model.safetensors", _set(HF_EXPERTS.format(2, 3, "up"), torch.zeros(31, 64))),
                        [HF_EXPERTS.format(2, 3, "up"), "(31, 64)", "(32, 64)", "model.safetensors"]),
        "missing-expert": (_safetensors("model.safetensors", lambda t: t.pop(HF_EXPERTS.format(3, 6, "down"))),
                           [HF_EXPERTS.format(3, 6, "down"), "missing"]),
    },
}
DAMAGE_CASES = [(case, damage) for case, (name, _) in CASES.items() for damage in DAMAGE.get(name, ())]


@pytest.mark.parametrize("case,damage", DAMAGE_CASES, ids=[f"{c}-{d}" for c, d in DAMAGE_CASES])
def test_damaged_source_is_refused_before_writing(moe, tmp_path, capsys, monkeypatch, paths_taken, case, damage):
    name = CASES[case][0]
    edit, fragments = DAMAGE[name][damage]
    src, dst = tmp_path / "src", tmp_path / "out" / "ckpt"
    shutil.copytree(moe.paths[name], src)
    edit(src)
    before = snapshot(src)
    lines = {}
    for copy_path in ("1", "0"):  # one reader validates each format, for both paths
        monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
        assert pmz(_command(moe, case, src, dst)) == 1
        lines[copy_path] = one_error_line(capsys.readouterr().err)
        _nothing_left(tmp_path / "out")
    monkeypatch.delenv("PMZ_COPY_PATH")
    line = lines["1"]
    assert line == lines["0"], lines
    assert line.startswith(f"pmz convert: error: {src}"), line
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in: {line}"
    assert snapshot(src) == before, "the source was changed"
    shutil.rmtree(src)
    shutil.copytree(moe.paths[name], src)
    _rerun_succeeds(moe, case, src, dst, paths_taken, capsys)


# ---------------------------------------------------------------------------------------------- signals

SIGNALLED = [(case, "SIGINT") for case in CASES if case in WRITERS] + [
    ("legacy-ep-to-vllm", "SIGTERM"), ("dist-to-grouped", "SIGTERM")]


def _held_mid_write(moe: Moe, case: str, tmp_path: Path, runs: list) -> tuple[HeldRun, list[int], Path]:
    """A ``pmz convert`` of ``case`` whose worker threads are held mid-write: the files are laid out at their final
    size in the temp dir and the tasks filling them have started."""
    name = CASES[case][0]
    dst = tmp_path / "out" / "ckpt"
    run = HeldRun(tmp_path, ["convert", moe.paths[name], dst, *CASES[case][1]])
    runs.append(run)
    threads = run.wait_workers_busy()
    assert all(os.path.exists(f"/proc/{run.proc.pid}/task/{t}") for t in threads), "not the copy path's threads"
    (tmp,) = temp_dirs(dst.parent, dst.name)
    laid_out = [p for p in tmp.rglob("*") if p.suffix in (".safetensors", ".pt", ".distcp")]
    assert laid_out, "the signal would not land during the write"
    return run, threads, dst


@linux_only
@pytest.mark.parametrize("case,sig", SIGNALLED, ids=[f"{c}-{s}" for c, s in SIGNALLED])
def test_signal_mid_write_leaves_nothing(moe, tmp_path, held_runs, capsys, paths_taken, case, sig):  # noqa: F811
    run, threads, dst = _held_mid_write(moe, case, tmp_path, held_runs)
    if sig == "SIGINT":
        os.killpg(run.proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
    else:
        os.kill(run.proc.pid, signal.SIGTERM)
    rc, _, err = run.finish(timeout=FINISH_S)
    assert (rc, one_error_line(err)) == ((130, "pmz convert: interrupted") if sig == "SIGINT" else
                                         (143, "pmz convert: terminated (SIGTERM)")), err
    _nothing_left(tmp_path / "out")
    wait_for(lambda: not any(alive(t) for t in threads), timeout=10, what="worker threads to end")
    _rerun_succeeds(moe, case, moe.paths[CASES[case][0]], dst, paths_taken, capsys)


@linux_only
@pytest.mark.parametrize("case", ["legacy-ep-to-vllm", "grouped-to-dist"])
def test_sigkill_mid_write_next_run_removes_the_temp_dir(moe, tmp_path, held_runs, capsys, paths_taken,  # noqa: F811
                                                         case):
    run, threads, dst = _held_mid_write(moe, case, tmp_path, held_runs)
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait()
    assert not dst.exists() and len(temp_dirs(dst.parent, dst.name)) == 1
    _rerun_succeeds(moe, case, moe.paths[CASES[case][0]], dst, paths_taken, capsys)


# ---------------------------------------------------------------------------------------------- a full disk


@linux_only
@pytest.mark.parametrize("case", WRITERS)
def test_file_size_limit_names_the_file(moe, tmp_path, capsys, paths_taken, case):
    """RLIMIT_FSIZE (writes fail with EFBIG as on a full disk): the files are laid out at their final size first,
    so the main thread meets it; one line naming the destination's file and the errno text."""
    src, dst = moe.paths[CASES[case][0]], tmp_path / "out" / "ckpt"
    proc = pmz_process(*_command(moe, case, src, dst), env=_env(), preexec_fn=_file_size_limit(64 << 10))
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    line = one_error_line(proc.stderr)
    assert line.startswith("pmz convert: error:") and f"{dst}{os.sep}" in line and "File too large" in line, line
    assert ".tmp-" not in line, line
    _nothing_left(tmp_path / "out")
    _rerun_succeeds(moe, case, src, dst, paths_taken, capsys)


@pytest.mark.parametrize("case", [*WRITERS, "qwen3-hf-to-stacked-dist"])
def test_disk_full_in_the_worker_threads(moe, tmp_path, capsys, monkeypatch, paths_taken, case):
    """ENOSPC from ``pwrite`` / ``pwritev`` (a disk filling up while the tensors are copied, in the worker
    threads): one line naming the destination's file and the errno text, nothing left, every thread ended."""
    lock, calls = threading.Lock(), [0]

    def full(real):
        def call(*args):
            with lock:
                calls[0] += 1
                if calls[0] > 2:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(*args)

        return call

    real = os.pwrite, os.pwritev
    monkeypatch.setattr(os, "pwrite", full(real[0]))
    monkeypatch.setattr(os, "pwritev", full(real[1]))
    src, dst = moe.paths[CASES[case][0]], tmp_path / "out" / "ckpt"
    assert pmz(_command(moe, case, src, dst)) == 1
    line = one_error_line(capsys.readouterr().err)
    assert calls[0] > 2, "no write failed"
    assert line.startswith("pmz convert: error:") and f"{dst}{os.sep}" in line, line
    assert "No space left on device" in line and ".tmp-" not in line, line
    _nothing_left(tmp_path / "out")
    assert not [t.name for t in threading.enumerate() if t.name.startswith("pmz-copy-")], "a worker thread is left"
    monkeypatch.setattr(os, "pwrite", real[0])
    monkeypatch.setattr(os, "pwritev", real[1])
    _rerun_succeeds(moe, case, src, dst, paths_taken, capsys)
