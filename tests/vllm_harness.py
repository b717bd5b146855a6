"""Running vLLM itself (``tests/vllm_client.py`` under ``.venv-vllm``) from the tests.

``run_clients`` starts one client process for a list of jobs (one interpreter and one vLLM import
for all of them; each job still builds and shuts down its own engine, without a process of its own:
TP-1 engines run in the client, TP-N engines in N rank processes spawned once per client, state jobs
in ranks spawned once per job, which may hold several models: tests/vllm_client.py). A job's result counts only
when the whole client finished cleanly: exit code 0 *and* the client's closing line
(``FINISHED_LINE``), which it prints after every engine was shut down and every distributed state
destroyed. A client that wrote its results and then crashed at exit fails the test (no retry, no
ignored exit code), and so does one that leaves processes running (the client runs in a session of
its own: EngineCore, TP workers and spawned ranks must all have ended) or vLLM shared-memory
segments in ``/dev/shm`` (new segments no live process maps; another run's engine on the same
machine is not counted).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
FINISHED_LINE = "pmz-vllm-client: finished"  # tests/vllm_client.py prints it last
SHM = Path("/dev/shm")
SURVIVOR_GRACE_S = 30.0  # how long the client's helper processes may take to end after it exits
JOB_LINE = "pmz-vllm-client: job"  # tests/vllm_client.py prints it on stderr as each job starts
DONE_LINE = "pmz-vllm-client: done"  # ... and this one, with the job's seconds, as each job ends
ALIVE_EVERY_S = 60.0  # with no other progress line for this long, say the client is still at work
# Writes a line to the terminal past pytest's output capture (tests/conftest.py sets it); plain
# stderr outside pytest.
say_on_terminal: Callable[[str], None] | None = None


def _say(line: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}]   {line}"
    if say_on_terminal is not None:
        say_on_terminal(line)
    else:
        print(line, file=sys.stderr, flush=True)


def _wait_speaking(client: subprocess.Popen, steps: str, timeout: float) -> tuple[str, str]:
    """``client.communicate(timeout)``, saying on the terminal what the client is at: a line as it
    starts, one as each job (engine) starts, one every ``ALIVE_EVERY_S`` without any, one at the end
    (a vLLM engine takes minutes to start on 2 cores; a silent stretch that long looks hung)."""
    out: list[str] = []
    err: list[str] = []
    jobs: list[str] = []  # the client's job lines, as they arrive

    def drain(stream, into: list[str], watch: bool) -> None:
        for line in stream:
            into.append(line)
            if watch and line.startswith(JOB_LINE):
                jobs.append(line[len(JOB_LINE):].strip())
            elif watch and line.startswith(DONE_LINE):
                _say(f"vLLM client: job {line[len(DONE_LINE):].strip()}")

    readers = [threading.Thread(target=drain, args=(client.stdout, out, False), daemon=True),
               threading.Thread(target=drain, args=(client.stderr, err, True), daemon=True)]
    for reader in readers:
        reader.start()
    start = last_said = time.monotonic()
    _say(f"vLLM client ({steps}) starting in .venv-vllm: importing vLLM, then its jobs one after another "
         "(an engine takes minutes to start on 2 cores) ...")
    said_jobs = 0
    while True:
        try:
            client.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if now - start > timeout:
            _say(f"vLLM client ({steps}): no result after {now - start:.0f} s, killing it")
            client.kill()
            client.wait()
            break
        if len(jobs) > said_jobs:
            said_jobs = len(jobs)
            _say(f"vLLM client: job {jobs[-1]} starting ({now - start:.0f} s in)")
            last_said = now
        elif now - last_said >= ALIVE_EVERY_S:
            at = f"at job {jobs[-1]}" if jobs else "importing vLLM"
            _say(f"vLLM client: still {at} ({now - start:.0f} s in)")
            last_said = now
    for reader in readers:
        reader.join(timeout=30)
    _say(f"vLLM client ({steps}) ended in {time.monotonic() - start:.0f} s (exit {client.returncode})")
    return "".join(out), "".join(err)


def _vllm_segments() -> set[str]:
    """Shared-memory files vLLM's CPU workers create (``vllm_dist_<id>-...-cpushm``, the state
    step's ``pmz-state-<pid>-...``)."""
    if not SHM.is_dir():
        return set()
    return {p.name for p in SHM.iterdir() if p.name.startswith(("vllm", "pmz-state-"))}


def _mapped_anywhere(names: list[str]) -> set[str]:
    """The segments among ``names`` some live process still maps (an engine of another test run on
    this machine, say): in use, not left behind."""
    wanted = {str(SHM / n) for n in names}
    found: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:  # the process ended, or is not ours to read
            continue
        for line in lines:
            path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
            if path.removesuffix(" (deleted)") in wanted:
                found.add(Path(path.removesuffix(" (deleted)")).name)
    return found


def _session_survivors(sid: int) -> list[int]:
    """Processes still alive in session ``sid`` (the client's: EngineCore, TP workers, spawned ranks)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 4 and int(fields[3]) == sid and fields[0] != "Z":  # fields[3]: session id
            alive.append(int(stat.parent.name))
    return alive


def run_clients(jobs: list[tuple[str, dict, Path]]) -> list[dict]:
    """Run ``jobs`` (``(step, args, out_file)``) in one vLLM client process; their JSON results."""
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON} missing: run tools/setup.sh (it creates the vLLM venv)"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "vllm_shims")])  # see its sitecustomize
    # vLLM's ZeroMQ IPC socket files (its shared-memory broadcast queue, engine sockets) go to a directory of this
    # run's, removed below: under the default (the system's temp dir) each client left 2-4 socket files behind
    rpc_dir = tempfile.mkdtemp(prefix="pmz-vllm-rpc-")
    env["VLLM_RPC_BASE_PATH"] = rpc_dir
    try:
        return _run_client(jobs, env)
    finally:
        shutil.rmtree(rpc_dir, ignore_errors=True)


def _run_client(jobs: list[tuple[str, dict, Path]], env: dict) -> list[dict]:
    before = _vllm_segments()
    payload = json.dumps([[step, args, str(out)] for step, args, out in jobs])
    # a session of its own: whatever the client started must have ended with it
    client = subprocess.Popen([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_client.py"), payload], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT),
                              start_new_session=True)
    steps = ", ".join(step for step, _, _ in jobs)
    kinds = [step for step, _, _ in jobs]
    short = ", ".join(f"{k} x{kinds.count(k)}" if kinds.count(k) > 1 else k for k in dict.fromkeys(kinds))
    out, err = _wait_speaking(client, short, timeout=900 * len(jobs))
    proc = subprocess.CompletedProcess(client.args, client.returncode, out, err)
    # the session id is the client's pid; helpers that end on their own once the client is gone
    # (multiprocessing's resource tracker waits for its pipe to close) get a grace period
    deadline = time.monotonic() + SURVIVOR_GRACE_S
    survivors = _session_survivors(client.pid)
    while survivors and time.monotonic() < deadline:
        time.sleep(0.5)
        survivors = _session_survivors(client.pid)
    for pid in survivors:  # do not leave them running whatever the verdict
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not survivors, f"vLLM client ({steps}) exited leaving processes {survivors} running"
    # a substring, not a whole line: a helper process of the client's sharing its stdout may end its
    # own output without a newline just before (one short write of the line itself is never split)
    finished = FINISHED_LINE in proc.stdout
    # vLLM 0.32's CPU client can still die in the interpreter's own teardown once everything is done ("terminate
    # called without an active exception", SIGABRT: 1 client run in ~25 on a clean clone, 2026-11-28), after every
    # engine was shut down, every result written and the finished line printed. That exit is counted, with the
    # checks that matter kept: nothing it started is left running (above), no shared memory left (below), every
    # result file whole. An abort before the finished line, or any other exit code, fails.
    aborted_at_exit = finished and proc.returncode == -signal.SIGABRT
    if not finished or (proc.returncode != 0 and not aborted_at_exit):
        tail = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if " INFO " not in line)[-4000:]
        pytest.fail(f"vLLM client ({steps}) did not finish cleanly (exit {proc.returncode}):\n{tail}")
    if aborted_at_exit:
        _say(f"vLLM client ({steps}) aborted in interpreter teardown after finishing (SIGABRT, results written): "
             f"counted")
    new = sorted(_vllm_segments() - before)
    left = sorted(set(new) - _mapped_anywhere(new))
    assert not left, f"vLLM client ({steps}) left shared-memory segments in /dev/shm: {left[:4]}"
    return [json.loads(Path(out).read_text()) for _, _, out in jobs]

