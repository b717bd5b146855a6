"""``pmz convert`` under faults of the machine and of other processes, run as a user runs it: real
subprocesses of ``python -m converters.cli``, real signals, real file size limits and permissions.

Every case must end in one line on stderr with the right exit status (1 error, 130 Ctrl-C, 143
SIGTERM), leave the source untouched and nothing beside the destination (no temp dir, no parent
directory created for it), and leave no worker behind: neither a thread of the copy path nor a
process of the torch path's pool may go on writing once the conversion has ended or was killed.

Slow phases are made deterministic with a ``sitecustomize`` hook (on PYTHONPATH of the child only)
that makes each worker task announce itself (its thread id: a worker process's main thread id is
its pid) and wait for a "go" file, or for its run to stop, as a long copy does between chunks: the
test acts (signals, races) while the workers are known to be mid-conversion.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cases import snapshot, write_hf_model

ROOT = Path(__file__).resolve().parent.parent
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process semantics")

HOOK = '''
import os
if os.environ.get("PMZ_TEST_MARKS"):
    import threading
    import time
    import converters.runtime.tasks as _tasks
    _original = _tasks._task_entry

    def _task_entry(payload):
        marks, me = os.environ["PMZ_TEST_MARKS"], threading.get_native_id()
        open(os.path.join(marks, f"worker-{me}"), "w").close()
        go, deadline = os.environ["PMZ_TEST_GO"], time.monotonic() + 120
        while not os.path.exists(go) and not _tasks.stop_requested() and time.monotonic() < deadline:
            time.sleep(0.02)
        result = _original(payload)
        open(os.path.join(marks, f"done-{me}-{time.monotonic_ns()}"), "w").close()
        return result

    _task_entry.__qualname__ = _task_entry.__name__ = "_task_entry"
    _task_entry.__module__ = "converters.runtime.tasks"
    _tasks._task_entry = _task_entry
'''


def _config(layers: int = 4):
    from transformers import LlamaConfig

    # embedding 90 x 32 fp32 = 11520 bytes: every output format has a file above the 8 KiB limit below
    return LlamaConfig(vocab_size=90, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=False)


# How long a signalled run may take to end: a bound against hanging, not a speed check. A clean-clone
# suite on a machine also running an 8 GB conversion benchmark saw Ctrl-C'd runs pass 60 s
# (the same tests take ~3 s each on a quiet machine).
FINISH_S = 240


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("faults_src"), "hf", _config(), seed=11)


def _env(hook: Path | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(([str(hook)] if hook else []) + [str(ROOT)])
    # These children run under file size limits and are killed mid-write: one must never write a bytecode
    # cache. Under RLIMIT_FSIZE CPython's pyc writer takes a short write for a whole one and renames the
    # truncated file into __pycache__ ("marshal data too short" for every later import of that module: a
    # clean-clone run lost 60 tests to converters/copy_path/vllm.py's 8192-byte pyc).
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra)
    return env


def pmz(*argv, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "converters.cli", *map(str, argv)], cwd=ROOT, capture_output=True,
                          text=True, timeout=kwargs.pop("timeout", 300), **kwargs)


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    assert "Traceback" not in stderr
    return lines[0]


def same_as_original(hf: Path, out: Path) -> None:
    original = load_file(str(hf / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == original.keys() and all(torch.equal(got[k], original[k]) for k in original)


def temp_dirs(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f".{name}.tmp-*")) if parent.exists() else []


def alive(pid: int) -> bool:
    """A process, or a thread (``/proc/<tid>`` exists while the thread runs), that has not ended."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_for(condition, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _foreground_signals() -> None:
    """In the child before exec: SIGINT and SIGQUIT back to their defaults (see ``HeldRun``)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


class HeldRun:
    """A ``pmz convert`` child whose worker tasks wait (after announcing their thread id) for
    ``release()``."""

    def __init__(self, tmp: Path, argv: list, workers: int = 2) -> None:
        self.hook = tmp / "hook"
        self.marks = tmp / "marks"
        self.hook.mkdir(exist_ok=True)
        self.marks.mkdir(exist_ok=True)
        (self.hook / "sitecustomize.py").write_text(HOOK)
        self.go = tmp / "go"
        self.workers = workers
        env = _env(self.hook, PMZ_TEST_MARKS=str(self.marks), PMZ_TEST_GO=str(self.go))
        # As a terminal's foreground job gets it: SIGINT and SIGQUIT at their defaults. A suite started in the
        # background of a non-interactive shell (`cmd &`) inherits them ignored, and pmz rightly keeps an
        # ignored SIGINT ignored (as `nohup` and shells expect), so the Ctrl-C tests would wait 240 s each.
        self.proc = subprocess.Popen([sys.executable, "-m", "converters.cli", *map(str, argv), "--workers",
                                      str(workers), "--quiet"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True,
                                     preexec_fn=_foreground_signals)

    def worker_pids(self) -> list[int]:  # thread ids (copy path) or process ids (torch path)
        return [int(p.name.split("-")[1]) for p in self.marks.glob("worker-*")]

    def wait_workers_busy(self) -> list[int]:
        wait_for(lambda: len(self.worker_pids()) >= self.workers or self.proc.poll() is not None, what="workers")
        assert self.proc.poll() is None, self.proc.communicate()
        return self.worker_pids()

    def release(self) -> None:
        self.go.touch()

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.communicate()


@pytest.fixture
def held_runs():
    runs: list[HeldRun] = []
    yield runs
    for run in runs:
        run.release()
        try:
            os.killpg(run.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        run.proc.communicate()


# ---------------------------------------------------------------------------------------------- signals


# The copy path runs its tasks in threads, the torch path (a dtype change) in worker processes.
PATHS = pytest.mark.parametrize("path_extra", [[], ["--dtype", "bf16"]], ids=["copy-threads", "torch-processes"])


def _check_workers(run: HeldRun, pids: list[int], path_extra: list) -> None:
    """The workers are what the path promises: threads of the conversion process, or other processes."""
    threads = [p for p in pids if Path(f"/proc/{run.proc.pid}/task/{p}").exists()]
    assert threads == (pids if not path_extra else []), (pids, threads)


@linux_only
@PATHS
@pytest.mark.parametrize("to,extra", [("hf", []), ("megatron", ["--tp", "2"])])
def test_ctrl_c_mid_conversion(hf, tmp_path, held_runs, to, extra, path_extra):
    """Ctrl-C reaches the whole process group: one line, exit 130, temp dir and new parents gone,
    no KeyboardInterrupt traceback from the parent or from any pool worker."""
    before = snapshot(hf)
    dst = tmp_path / "out" / "ckpt"
    run = HeldRun(tmp_path, ["convert", hf, dst, "--to", to, *extra, *path_extra])
    held_runs.append(run)
    pids = run.wait_workers_busy()
    _check_workers(run, pids, path_extra)
    assert temp_dirs(dst.parent, dst.name), "the conversion should be writing into its temp dir by now"
    os.killpg(run.proc.pid, signal.SIGINT)
    rc, out, err = run.finish(timeout=FINISH_S)
    assert rc == 130, (rc, err)
    assert one_error_line(err) == "pmz convert: interrupted"
    assert "KeyboardInterrupt" not in err
    assert not (tmp_path / "out").exists(), "temp dir or created parent left behind"
    wait_for(lambda: not any(alive(p) for p in pids), timeout=60, what="workers to exit")
    assert snapshot(hf) == before


@linux_only
@PATHS
def test_sigterm_cleans_up_like_ctrl_c(hf, tmp_path, held_runs, path_extra):
    dst = tmp_path / "out" / "hf"
    run = HeldRun(tmp_path, ["convert", hf, dst, "--to", "hf", *path_extra])
    held_runs.append(run)
    pids = run.wait_workers_busy()
    _check_workers(run, pids, path_extra)
    os.kill(run.proc.pid, signal.SIGTERM)  # the parent only, as a service manager or `kill` would
    rc, out, err = run.finish(timeout=FINISH_S)
    assert rc == 143, (rc, err)
    assert one_error_line(err) == "pmz convert: terminated (SIGTERM)"
    assert not (tmp_path / "out").exists()
    wait_for(lambda: not any(alive(p) for p in pids), timeout=60, what="workers to exit")


@linux_only
@PATHS
def test_sigkill_workers_die_with_parent_and_next_run_cleans_up(hf, tmp_path, held_runs, path_extra):
    """SIGKILL cannot be handled: the workers must die with the parent (they would otherwise go on
    writing into the temp dir), and the next run for the same destination removes the stale temp dir."""
    dst = tmp_path / "out" / "hf"
    run = HeldRun(tmp_path, ["convert", hf, dst, "--to", "hf", *path_extra])
    held_runs.append(run)
    pids = run.wait_workers_busy()
    _check_workers(run, pids, path_extra)
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait()  # not communicate(): orphaned workers would hold its stdout/stderr pipes open
    wait_for(lambda: not any(alive(p) for p in pids), timeout=60, what="orphaned workers to die")
    stale = temp_dirs(dst.parent, dst.name)
    assert len(stale) == 1
    left = snapshot(stale[0])
    run.release()  # an orphan still alive would now go on writing
    time.sleep(1.0)
    assert snapshot(stale[0]) == left and not list(run.marks.glob("done-*"))

    proc = pmz("convert", hf, dst, "--to", "hf", "--quiet", "--workers", "2", env=_env())
    assert proc.returncode == 0, proc.stderr
    assert temp_dirs(dst.parent, dst.name) == [], "the stale temp dir of the killed run is still there"
    assert sorted(p.name for p in dst.parent.iterdir()) == ["hf"]
    same_as_original(hf, dst)


@linux_only
@PATHS
def test_sigkill_during_overwrite_keeps_the_old_destination(hf, tmp_path, held_runs, path_extra):
    """``--overwrite`` replaces the destination only once the new one is complete: a run killed with
    SIGKILL mid-write leaves the old destination exactly as it was (plus a stale temp dir beside
    it), and the next run removes the temp dir and replaces the destination."""
    dst = tmp_path / "out" / "ckpt"
    first = pmz("convert", hf, dst, "--to", "megatron", "--tp", "2", "--quiet", env=_env())
    assert first.returncode == 0, first.stderr
    old = snapshot(dst)
    run = HeldRun(tmp_path, ["convert", hf, dst, "--to", "hf", "--overwrite", *path_extra])
    held_runs.append(run)
    pids = run.wait_workers_busy()
    _check_workers(run, pids, path_extra)
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait()
    wait_for(lambda: not any(alive(p) for p in pids), timeout=60, what="orphaned workers to die")
    assert snapshot(dst) == old, "the killed --overwrite run changed the existing destination"
    assert len(temp_dirs(dst.parent, dst.name)) == 1

    proc = pmz("convert", hf, dst, "--to", "hf", "--overwrite", "--quiet", "--workers", "2", env=_env())
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in dst.parent.iterdir()) == ["ckpt"], "stale temp dir or old destination left"
    same_as_original(hf, dst)


@linux_only
def test_racing_conversions_to_one_destination(hf, tmp_path, held_runs):
    """Two runs to the same new destination: the first to finish wins; the other refuses to replace
    it (one line naming it, its temp dir removed). A run never removes the temp dir of a live one."""
    dst = tmp_path / "out" / "hf"
    slow = HeldRun(tmp_path, ["convert", hf, dst, "--to", "hf"])
    held_runs.append(slow)
    slow.wait_workers_busy()
    slow_tmp = temp_dirs(dst.parent, dst.name)
    assert len(slow_tmp) == 1

    fast = pmz("convert", hf, dst, "--to", "megatron", "--tp", "2", "--quiet", "--workers", "2", env=_env())
    assert fast.returncode == 0, fast.stderr
    assert slow_tmp[0].is_dir(), "the second run removed the temp dir of a live run"
    winner = snapshot(dst)

    slow.release()
    rc, out, err = slow.finish()
    assert rc == 1, (rc, out, err)
    line = one_error_line(err)
    assert line.startswith("pmz convert: error:") and str(dst) in line and "--overwrite" in line, line
    assert snapshot(dst) == winner, "the loser replaced the winner's output"
    assert sorted(p.name for p in dst.parent.iterdir()) == ["hf"], "the loser left its temp dir"


@linux_only
def test_stale_temp_dirs_of_live_runs_are_kept(tmp_path):
    """Unit check of the cleanup rule: only unlocked temp dirs of the same destination go."""
    import fcntl

    from converters.runtime.staging import remove_stale_temp_dirs

    parent = tmp_path / "out"
    parent.mkdir()
    dead = parent / ".hf.tmp-4242-0a1b2c3d"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"partial")
    live = parent / ".hf.tmp-4343-deadbeef"
    live.mkdir()
    (live / "model.safetensors").write_bytes(b"partial")
    just_made = parent / ".hf.tmp-4444-00000000"  # empty and new: its owner may be about to lock it
    just_made.mkdir()
    other = parent / ".hf2.tmp-4545-0a1b2c3d"  # another destination's
    other.mkdir()
    (other / "x").write_text("x")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(live)!r}, os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
                               "print('locked', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        removed = remove_stale_temp_dirs(parent / "hf")
        assert removed == [dead]
        assert live.is_dir() and just_made.is_dir() and other.is_dir() and not dead.exists()
    finally:
        holder.kill()
        holder.wait()
    fd = os.open(live, os.O_RDONLY)  # the lock went with its holder
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)
    assert remove_stale_temp_dirs(parent / "hf") == [live]


# ---------------------------------------------------------------------------------------------- the file system


def _file_size_limit(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead of killing us

    return apply


@linux_only
@pytest.mark.parametrize("to,extra", [("hf", []), ("hf", ["--dtype", "bf16"]), ("megatron", ["--tp", "2"]),
                                      ("megatron-dist", []), ("vllm", [])],
                         ids=["hf-copy", "hf-torch", "megatron", "megatron-dist", "vllm"])
@pytest.mark.parametrize("workers", [1, 2])
def test_full_disk_names_the_file_and_leaves_nothing(hf, tmp_path, to, extra, workers):
    """A file size limit makes writes fail as a full disk does (EFBIG instead of ENOSPC), in the
    parent and in workers alike; torch.save's own error (legacy target) must not hide the errno."""
    before = snapshot(hf)
    dst = tmp_path / "out" / "ckpt"
    proc = pmz("convert", hf, dst, "--to", to, *extra, "--quiet", "--workers", workers, env=_env(),
               preexec_fn=_file_size_limit(8192))
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    line = one_error_line(proc.stderr)
    assert line.startswith("pmz convert: error:"), line
    assert f"{dst}{os.sep}" in line, f"the file being written is not named: {line}"
    assert "File too large" in line, f"no errno text: {line}"
    assert "inline_container" not in line
    assert not (tmp_path / "out").exists(), "something was left behind"
    assert snapshot(hf) == before


@linux_only
def test_torch_save_to_a_path_failing_is_an_oserror_naming_the_file(tmp_path):
    """The mapping for writers that still ``torch.save`` to a path (no errno survives there)."""
    target = tmp_path / "common.pt"
    code = ("import sys, torch\nfrom converters.runtime.tasks import os_error_of\n"
            "try:\n    torch.save({'a': torch.zeros(10000)}, sys.argv[1])\n"
            "except RuntimeError as exc:\n    err = os_error_of(exc)\n    print(type(err).__name__, err.filename)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, cwd=ROOT,
                          env=_env(), preexec_fn=_file_size_limit(4096), timeout=120)
    assert proc.stdout.split() == ["OSError", str(target)], proc.stdout + proc.stderr


def _without_root_override() -> None:
    """In the child, before exec: root loses the capabilities that let it write anywhere (dropped from
    the bounding set, so the exec'd interpreter never gets them); file modes then apply to it too."""
    if os.geteuid() != 0:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


@linux_only
def test_read_only_destination_parent(hf, tmp_path):
    """One line naming the directory and the errno text, before anything is read; nothing created."""
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    try:
        probe = subprocess.run([sys.executable, "-c", f"open({str(ro / 'probe')!r}, 'w')"], capture_output=True,
                               preexec_fn=_without_root_override)
        if probe.returncode == 0:
            os.unlink(ro / "probe")
            pytest.skip("this process cannot give up its permission to write into read-only directories")
        for dst in (ro / "hf", ro / "new" / "hf"):
            proc = pmz("convert", hf, dst, "--to", "hf", "--quiet", env=_env(), preexec_fn=_without_root_override)
            assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
            line = one_error_line(proc.stderr)
            assert line.startswith("pmz convert: error:") and str(ro) in line and "Permission denied" in line, line
            assert list(ro.iterdir()) == []
    finally:
        os.chmod(ro, 0o755)


# ---------------------------------------------------------------------------------------------- sizes


@linux_only
@pytest.mark.parametrize("key,value", [("num_hidden_layers", 10**9), ("hidden_size", 2**40),
                                       ("vocab_size", 10**12)])
@pytest.mark.parametrize("to", ["hf", "megatron"])
def test_absurd_config_fails_fast_without_allocating(hf, tmp_path, key, value, to):
    """A config.json claiming 10^9 layers (or a huge hidden/vocab size) is compared with the tensors
    present before any per-layer table is built: one line naming config.json and the number, well
    inside a 4 GiB address-space limit (no wall-time bound: the subprocess timeout only guards a hang)."""
    import json

    src = tmp_path / "src"
    shutil.copytree(hf, src)
    data = json.loads((src / "config.json").read_text())
    data[key] = value
    (src / "config.json").write_text(json.dumps(data))

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    proc = pmz("convert", src, tmp_path / "out" / "x", "--to", to, "--quiet", env=_env(), preexec_fn=limit_memory,
               timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    line = one_error_line(proc.stderr)
    assert str(src / "config.json") in line and f"{key}={value}" in line, line
    assert not (tmp_path / "out").exists()
    # inspect and verify read the same config
    proc = pmz("inspect", src, env=_env(), preexec_fn=limit_memory, timeout=120)
    assert proc.returncode == 1 and f"{key}={value}" in one_error_line(proc.stderr), proc.stderr[-2000:]
