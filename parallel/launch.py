"""Run a function in N local processes with a process group, and collect each rank's return value.

For tests, demos and tools on one machine (gloo on CPU); real jobs use ``torchrun``. Spawning and
importing cost seconds per process, so callers run many cases inside one call. The function must be
importable by module path (module level, or in a script with an ``if __name__ == "__main__"``
guard). An exception on any rank is re-raised in the parent with that rank's traceback.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, queue, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world)
        result = fn(*args)
        # Rank 0 hosts the rendezvous store: a rank done early (e.g. one that only raised local errors)
        # must not take it down while others still create their groups.
        dist.barrier()
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(world: int, fn, *args, timeout: float = 900.0, backend: str = "gloo") -> list:
    """``[fn(*args) on rank r for r in range(world)]``, each rank in its own process (one thread each)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue, backend), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
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
    for p in procs:
        p.join(timeout=5 if errors else timeout)
        if p.is_alive():
            p.terminate()
    if errors:
        raise RuntimeError("distributed worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
