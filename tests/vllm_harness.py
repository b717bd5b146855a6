"""Running vLLM itself (``tests/vllm_client.py`` under ``.venv-vllm``) from the tests.

``run_clients`` starts one client process for a list of jobs (one interpreter and one vLLM import
for all of them; each job still builds and shuts down its own engine). A job's result counts only
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
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
FINISHED_LINE = "pmz-vllm-client: finished"  # tests/vllm_client.py prints it last
SHM = Path("/dev/shm")
SURVIVOR_GRACE_S = 30.0  # how long the client's helper processes may take to end after it exits


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
    before = _vllm_segments()
    payload = json.dumps([[step, args, str(out)] for step, args, out in jobs])
    # a session of its own: whatever the client started must have ended with it
    client = subprocess.Popen([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_client.py"), payload], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT),
                              start_new_session=True)
    try:
        out, err = client.communicate(timeout=900 * len(jobs))
    except subprocess.TimeoutExpired:
        client.kill()
        out, err = client.communicate()
    proc = subprocess.CompletedProcess(client.args, client.returncode, out, err)
    steps = ", ".join(step for step, _, _ in jobs)
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
    if proc.returncode != 0 or FINISHED_LINE not in proc.stdout.splitlines():
        tail = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if " INFO " not in line)[-4000:]
        pytest.fail(f"vLLM client ({steps}) did not finish cleanly (exit {proc.returncode}):\n{tail}")
    new = sorted(_vllm_segments() - before)
    left = sorted(set(new) - _mapped_anywhere(new))
    assert not left, f"vLLM client ({steps}) left shared-memory segments in /dev/shm: {left[:4]}"
    return [json.loads(Path(out).read_text()) for _, _, out in jobs]

