"""Run a function in N spawned CPU processes over gloo and collect each rank's return value.

Spawning and importing cost seconds per process, so tests run many cases inside one call. The
worker function must be importable by module path (defined at module level). An exception on any
rank is re-raised in the parent with that rank's traceback.
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


def _entry(rank: int, world: int, port: int, fn, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(*args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(world: int, fn, *args, timeout: float = 900.0) -> list:
    """``[fn(*args) on rank r for r in range(world)]``, each rank in its own gloo process."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue), daemon=True) for r in range(world)]
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
        raise AssertionError("distributed worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
