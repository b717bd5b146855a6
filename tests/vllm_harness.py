"""Running vLLM itself (``tests/vllm_client.py`` under ``.venv-vllm``) from the tests.

``run_clients`` runs one client process for a list of jobs, forked from the session's client server
(``tests/vllm_server.py``: one interpreter and one vLLM import for the whole session, started by the
first call; each job still builds and shuts down its own engine, without a process of its own:
TP-1 engines run in the client, TP-N engines in N rank processes forked once per client, state jobs
in ranks forked once per job, which may hold several models; ranks are spawned instead where the client has a
second thread, or with ``PMZ_VLLM_SPAWN_RANKS=1``: tests/vllm_client.py). A job's result counts only
when the whole client finished cleanly: exit code 0 *and* the client's closing line
(``FINISHED_LINE``), which it prints after every engine was shut down and every distributed state
destroyed. A client that wrote its results and then crashed at exit fails the test (no retry, no
ignored exit code), and so does one that leaves processes running (the client runs in a session of
its own: EngineCore, TP workers and spawned ranks must all have ended) or vLLM shared-memory
segments in ``/dev/shm`` (new segments no live process maps; another run's engine on the same
machine is not counted). A client that kills the server (the only way one could: it is a process of its
own) fails its own call, and the next call starts a new server. ``close_server`` ends the server at the
end of the session (tests/conftest.py: a server that does not end cleanly fails the run).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
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
    _say(f"vLLM client ({steps}) starting: forked from the session's client server in .venv-vllm (the first "
         "imports vLLM), then its jobs one after another (an engine takes minutes to start on 2 cores) ...")
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
            at = f"at job {jobs[-1]}" if jobs else "starting (importing vLLM in a new server?)"
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


class _Server:
    """The session's ``tests/vllm_server.py`` process and this end of its socket (SOCK_SEQPACKET: one message
    per request or reply); its output goes to a file, shown when it fails."""

    def __init__(self, env: dict) -> None:
        self.conn, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile()
        with theirs:  # a session of its own: whatever it started must have ended with it
            self.proc = subprocess.Popen([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_server.py"),
                                          str(theirs.fileno())], env=env, pass_fds=[theirs.fileno()],
                                         stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                         cwd=str(ROOT), start_new_session=True)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def close(self, timeout: float = 60.0) -> str | None:
        """End the server; what was wrong with its end, or None."""
        with contextlib.suppress(OSError):  # it may have ended already
            self.conn.send(b"end")
        self.conn.close()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        survivors = _session_survivors(self.proc.pid)
        for pid in survivors:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.log.close()
        if code != 0 or survivors:
            left = f", leaving processes {survivors} running" if survivors else ""
            return f"the vLLM client server ended with exit {code}{left}"
        return None


_SERVER: list[_Server] = []  # the session's server, once started


def _server(env: dict) -> _Server:
    """The running server, started (again, with ``env``) when there is none or the last one has ended."""
    if _SERVER and _SERVER[0].proc.poll() is not None:
        _SERVER.pop().close()  # its end was already a failure of the call that saw it
    if not _SERVER:
        _SERVER.append(_Server(env))
    return _SERVER[0]


def close_server() -> str | None:
    """End the session's server, if one was started; what was wrong with its end, or None."""
    return _SERVER.pop().close() if _SERVER else None


atexit.register(close_server)  # outside pytest; tests/conftest.py closes it first and checks the verdict


class _ForkedClient:
    """A client forked by the server, looking like the ``Popen`` it replaces: ``pid`` (also its session id),
    ``stdout``/``stderr`` (pipes), ``wait``, ``kill``, ``returncode``. The server replies with its pid once
    forked and its exit status once ended; no reply at all (the server ended) counts as exit 255."""

    def __init__(self, server: _Server, payload: list, env: dict) -> None:
        self.server, self.args = server, ["vllm_server", "fork"]
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            socket.send_fds(server.conn, [json.dumps({"jobs": payload, "env": env}).encode()], [out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        self.stdout, self.stderr = open(out_r), open(err_r)
        self.pid: int | None = None
        self.returncode: int | None = None

    def _reply(self, timeout: float | None) -> int | None:
        self.server.conn.settimeout(timeout)
        try:
            data = self.server.conn.recv(64)
        except TimeoutError:
            return None
        except OSError:
            data = b""
        if not data:  # the server ended: this call fails, the next one starts a new server
            self.pid = self.pid or -1
            self.returncode = 255
            return None
        return int(data)

    def wait(self, timeout: float | None = None) -> int:
        while self.returncode is None:
            reply = self._reply(timeout)
            if reply is None and self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            if self.pid is None:
                self.pid = reply
            elif self.returncode is None:
                self.returncode = reply
        return self.returncode

    def kill(self) -> None:
        if self.pid is None or self.pid < 0:  # not forked yet (the server stuck importing): end the server
            self.server.proc.kill()
        else:
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGKILL)


def run_clients(jobs: list[tuple[str, dict, Path]]) -> list[dict]:
    """Run ``jobs`` (``(step, args, out_file)``) in one vLLM client process; their JSON results."""
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON} missing: run tools/setup.sh (it creates the vLLM venv)"
    # this call's environment, set in its client (the server's is the first call's)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "vllm_shims")])  # see its sitecustomize
    # vLLM's ZeroMQ IPC socket files (its shared-memory broadcast queue, engine sockets) go to a directory of this
    # call's, removed below: under the default (the system's temp dir) each client left 2-4 socket files behind
    rpc_dir = tempfile.mkdtemp(prefix="pmz-vllm-rpc-")
    env["VLLM_RPC_BASE_PATH"] = rpc_dir
    try:
        return _run_client(jobs, env)
    finally:
        shutil.rmtree(rpc_dir, ignore_errors=True)


def _run_client(jobs: list[tuple[str, dict, Path]], env: dict) -> list[dict]:
    before = _vllm_segments()
    server = _server({k: v for k, v in env.items() if k != "VLLM_RPC_BASE_PATH"})
    client = _ForkedClient(server, [[step, args, str(out)] for step, args, out in jobs], env)
    steps = ", ".join(step for step, _, _ in jobs)
    kinds = [step for step, _, _ in jobs]
    short = ", ".join(f"{k} x{kinds.count(k)}" if kinds.count(k) > 1 else k for k in dict.fromkeys(kinds))
    out, err = _wait_speaking(client, short, timeout=900 * max(1, len(jobs)))
    if client.pid is None:  # killed before it was forked
        client.pid = -1
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
        if server.proc.poll() is not None:
            tail += f"\nthe vLLM client server ended (exit {server.proc.returncode}):\n{server.output()[-2000:]}"
        pytest.fail(f"vLLM client ({steps}) did not finish cleanly (exit {proc.returncode}):\n{tail}")
    if aborted_at_exit:
        _say(f"vLLM client ({steps}) aborted in interpreter teardown after finishing (SIGABRT, results written): "
             f"counted")
    new = sorted(_vllm_segments() - before)
    left = sorted(set(new) - _mapped_anywhere(new))
    assert not left, f"vLLM client ({steps}) left shared-memory segments in /dev/shm: {left[:4]}"
    return [json.loads(Path(out).read_text()) for _, _, out in jobs]

