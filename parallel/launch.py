"""Run a function in N local processes with a process group, and collect each rank's return value.

For tests, demos and tools on one machine (gloo on CPU); real jobs use ``torchrun``. Spawning and
importing cost seconds per process, so callers run many cases inside one call. The function must be
importable by module path (module level, or in a script with an ``if __name__ == "__main__"``
guard). An exception on any rank is re-raised in the parent with that rank's traceback.

The rendezvous store lives in the parent, on a port the OS chose when the store bound it: there is
no window between picking a free port and binding it in which another process can take it (the
race ``free_port`` has), and no rank's exit can take the store down while others still use it.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A port free now (for launchers that must name one up front, e.g. torchrun's environment);
    another process may take it before it is bound, so prefer a store bound to port 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, world: int, port: int, fn, args, backend: str, timeout: float,
             cleanup=None) -> tuple[str, object]:
    """One rank's call in a process of its own: the rendezvous environment, a client of the parent's
    store on ``port``, a process group, ``fn(*args)``, a barrier; ``("ok", result)`` or ``("error",
    traceback)``. ``cleanup`` (optional) runs before the group is destroyed, which it always is."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        result = fn(*args)
        # A rank done early (e.g. one that only raised local errors) waits for the others, so every
        # rank's result is in before any group is destroyed.
        dist.barrier()
        return "ok", result
    except BaseException:  # noqa: BLE001 - report everything to the parent
        return "error", traceback.format_exc()
    finally:
        if cleanup is not None:
            cleanup()
        if dist.is_initialized():
            dist.destroy_process_group()


def _entry(rank: int, world: int, port: int, fn, args, queue, backend: str, timeout: float) -> None:
    torch.set_num_threads(1)
    status, payload = run_rank(rank, world, port, fn, args, backend, timeout)
    queue.put((rank, status, payload))


def run_distributed(world: int, fn, *args, timeout: float = 900.0, backend: str = "gloo") -> list:
    """``[fn(*args) on rank r for r in range(world)]``, each rank in its own process (one thread each)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # the parent holds the store (port 0: the OS picks one as it binds) until every rank has ended
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    procs = [ctx.Process(target=_entry, args=(r, world, store.port, fn, args, queue, backend, timeout), daemon=True)
             for r in range(world)]
    results: dict[int, object] = {}
    errors = []
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(results) < world and not errors:
            try:
                rank, status, payload = queue.get(timeout=2.0)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    errors.append(f"worker(s) died or timed out: exit codes {[p.exitcode for p in procs]}")
                continue
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:  # whatever ended the wait (an error, Ctrl-C, a start that failed), no rank outlives the call
        for p in procs:
            if p.pid is None:
                continue  # never started
            p.join(timeout=5 if errors or len(results) < world else timeout)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        del store  # the rendezvous ends only once every rank has
    if errors:
        raise RuntimeError("distributed worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
