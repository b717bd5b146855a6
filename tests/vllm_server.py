"""The session's vLLM client server: run with the interpreter of ``.venv-vllm`` by ``tests/vllm_harness.py``.

    .venv-vllm/bin/python tests/vllm_server.py FD

A test module's vLLM client (``tests/vllm_client.py``) started as a new interpreter spent ~10 s (quiet 2-core
VM) to ~18 s (load 8) importing torch and vLLM before its first job, once per module (~10 modules a suite).
This process imports them once for the session and forks one client per batch of jobs instead: the child is
the same client (``vllm_client.main``, the same jobs, engines and ranks, the same ``FINISHED_LINE`` last),
started with vLLM imported. Nothing runs here but the import and the loop below, so this process stays
single-threaded (a fork of it is safe: no thread pool exists; ``vllm_client._start_ranks`` checks its own
process the same way before forking ranks), and a client that crashes ends alone: the next batch gets a
fresh child of an untouched parent.

``FD`` is this end of a Unix socket pair. Each request is one message: a JSON object (``jobs``: the client's
job list; ``env``: the environment of the harness's call, set in the child over the server's, with the
call's own ``VLLM_RPC_BASE_PATH``) with two file
descriptors, the child's stdout and stderr. The reply is two lines: the child's pid once forked (it starts a
session of its own, so its pid is its session id: the harness checks that nothing in it survives), then its
exit status as ``subprocess`` writes one (negative: killed by that signal). The message ``end`` (or the end
of the socket) ends the server: exit 0 without an interpreter teardown, as nothing here holds anything to
release (a forked process may hold a copy of the harness's end, so the harness does not wait for the end of
the socket).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_client  # noqa: E402  sets the client's environment defaults first

MAX_REQUEST = 1 << 24  # bytes of one request's JSON


def _child(jobs: list, env: dict, out_fd: int, err_fd: int) -> None:
    """The forked client: a session of its own, the harness's pipes as stdout and stderr, ``main``, exit."""
    code = 1
    try:
        os.setsid()
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        os.environ.update(env)
        vllm_client.main(jobs)
        code = 0
    except BaseException:  # noqa: BLE001  any failure is this child's exit status, never the server's
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # a forked child: the server's interpreter state is not its to tear down


def _status(wait_status: int) -> int:
    return -os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)


def serve(conn: socket.socket) -> None:
    vllm_client.import_vllm()
    while True:
        message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 2)
        if message in (b"", b"end"):
            for fd in fds:
                os.close(fd)
            return
        request = json.loads(message)
        assert len(fds) == 2, f"a request carries stdout and stderr, got {len(fds)} descriptors"
        threads = len(os.listdir("/proc/self/task"))
        assert threads == 1, f"the vLLM client server has {threads} threads: forking it is not safe"
        pid = os.fork()
        if pid == 0:
            conn.close()
            _child(request["jobs"], request["env"], *fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        _, wait_status = os.waitpid(pid, 0)
        conn.sendall(f"{_status(wait_status)}\n".encode())


if __name__ == "__main__":
    code = 1
    try:
        serve(socket.socket(fileno=int(sys.argv[1])))
        code = 0
    except BaseException:  # noqa: BLE001  shown by the harness from this process's output
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
