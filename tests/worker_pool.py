"""Rank processes started once per test module and reused (issue 39 item 2): ``run(world, fn, *args)``
has ``parallel.launch.run_distributed``'s contract - ``[fn(*args) on rank r]``, each rank in its own
process with a gloo process group, an exception on any rank re-raised in the parent with that rank's
traceback - but the ranks of a world size are kept between the calls of a test module (tests/conftest.py
ends them after each module), so torch, transformers and the project are imported once per module and
world size instead of once per call (10 s per 2-rank call and 17 s per
4-rank call on the 2-core VM under load; ~80 such calls in the suite). The ranks themselves are forked from
multiprocessing's fork server, which imported the heavy libraries once for the session
(``FORK_SERVER_PRELOAD``): a new module's ranks start in 1-3 s instead of the 5-28 s of a spawn.

Each call is a fresh start for the function: a new rendezvous store (port 0, held by the parent) and a
new process group, destroyed after the call; the parent's current environment (so a ``monkeypatch.
setenv`` before the call reaches the ranks, as a fresh spawn would see it), working directory, torch's
default seed and dtype and one thread per rank are put back before every call. Anything else a
function changes in its process (a module attribute it patched and did not restore) stays for the next
call in that process: rank bodies must leave their process as they found it, as in any long-lived worker.

A call that fails on any rank, times out, or loses a rank ends that world size's processes (a rank left
waiting in a collective cannot be reused) and the next call starts new ones; the failing call raises
with every rank's traceback. Ranks are also replaced after ``RECYCLE_AFTER`` calls (their memory only
grows), and at most ``MAX_POOLS`` world sizes are kept (the least recently used one is closed).
``PMZ_TEST_POOL=0`` runs every call in fresh processes (``parallel.launch.run_distributed``).
"""

from __future__ import annotations

import atexit
import gc
import itertools
import os
import pickle
import queue as queue_mod
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.launch import run_rank

RECYCLE_AFTER = 25
ERROR_GRACE = 10.0  # seconds the other ranks get to answer once one failed, so every rank's traceback is shown
MAX_POOLS = 2
_INITIAL_SEED = torch.initial_seed()  # what a fresh process starts from (torch's fixed default seed)


def _serve(rank: int, world: int, inbox, outbox) -> None:
    """One rank's loop: run each task with a fresh process group until told to stop (``None``)."""
    while True:
        task = inbox.get()
        if task is None:
            return
        task_id, port, env, cwd, fn, args, timeout, backend = task
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        torch.manual_seed(_INITIAL_SEED)
        torch.set_default_dtype(torch.float32)
        torch.set_num_threads(1)
        status, payload = run_rank(rank, world, port, fn, args, backend, timeout, cleanup=_reset_library_state)
        del fn, args
        outbox.put((rank, task_id, status, payload))
        del payload
        gc.collect()


def _reset_library_state() -> None:
    """Process-wide state of the libraries rank bodies use that outlives a process group: megatron-core's
    model-parallel groups and RNG tracker (an oracle that initialised them would make the next call's
    ``initialize_model_parallel`` fail: "data parallel group is already initialized")."""
    import contextlib
    import sys

    with contextlib.suppress(Exception):  # a reset that fails must not end the rank's loop
        if "megatron.core.parallel_state" in sys.modules:
            sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
        if "megatron.core.tensor_parallel.random" in sys.modules:
            sys.modules["megatron.core.tensor_parallel.random"].get_cuda_rng_tracker().reset()


# Imported once, in multiprocessing's fork server (started with the first pool of the session), so that a rank
# process forked from it starts with them loaded: a spawned rank imported torch, transformers and the project
# itself, 5-8 s per 2-rank pool on a quiet 2-core VM (7.6-26 s under load; ~60 pools in a suite), a forked one
# starts in 1.4-2 s under the same load. The fork server is a fresh interpreter, single-threaded when it forks,
# and nothing here reads the environment at import (each call puts the parent's environment back anyway).
FORK_SERVER_PRELOAD = ["torch", "torch.distributed", "numpy", "safetensors.torch", "transformers",
                       "transformers.modeling_utils", "tests.worker_pool", "tests.workers", "tests.cases"]


def _context():
    """The fork-server context with the preload list set (``PMZ_TEST_POOL_START=spawn``: spawned ranks)."""
    method = os.environ.get("PMZ_TEST_POOL_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)
    return ctx


class _Pool:
    """``world`` rank processes and their queues."""

    def __init__(self, world: int) -> None:
        ctx = _context()
        self.world = world
        self.calls = 0
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(r, world, self.inboxes[r], self.outbox), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, task_id: int, fn, args, timeout: float, backend: str) -> tuple[dict, list[str]]:
        store = dist.TCPStore("127.0.0.1", 0, self.world + 1, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout))
        env, cwd = dict(os.environ), os.getcwd()
        pickle.dumps((fn, args))  # an argument that cannot travel fails here, as a fresh spawn's start would
        for q in self.inboxes:  # (a queue pickles in a feeder thread, where the error would only be printed)
            q.put((task_id, store.port, env, cwd, fn, args, timeout, backend))
        self.calls += 1
        results: dict[int, object] = {}
        errors: list[str] = []
        answered: set[int] = set()
        deadline = time.monotonic() + timeout
        try:
            while len(answered) < self.world:
                try:
                    rank, tid, status, payload = self.outbox.get(timeout=0.5 if errors else 2.0)
                except queue_mod.Empty:
                    dead = [p.exitcode for p in self.procs if not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        errors.append(f"worker(s) died or timed out: exit codes {[p.exitcode for p in self.procs]}")
                        break
                    continue
                if tid != task_id:  # a late answer of an earlier, failed call (its pool was closed): ignore
                    continue
                answered.add(rank)
                if status == "ok":
                    results[rank] = payload
                else:  # the other ranks' answers follow (their collectives fail), the first cause among them
                    errors.append(f"rank {rank}:\n{payload}")
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE)
        finally:
            del store  # held until every rank answered (or the pool is closed below)
        return results, errors

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.inboxes:
                q.put(None)
        for p in self.procs:
            if p.pid is None:
                continue
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_pools: dict[int, _Pool] = {}
_task_ids = itertools.count()


def close_all() -> None:
    """End every kept rank process (tests/conftest.py: after each test module)."""
    for world in list(_pools):
        _pools.pop(world).close()


atexit.register(close_all)


def run(world: int, fn, *args, timeout: float = 900.0, backend: str = "gloo") -> list:
    """``[fn(*args) on rank r for r in range(world)]`` on this module's ranks of that world size."""
    if os.environ.get("PMZ_TEST_POOL", "1") == "0":
        from parallel.launch import run_distributed

        return run_distributed(world, fn, *args, timeout=timeout, backend=backend)
    pool = _pools.pop(world, None)  # re-inserted last: the dict's order is least recently used first
    if pool is not None and (pool.calls >= RECYCLE_AFTER or not all(p.is_alive() for p in pool.procs)):
        pool.close(kill=not all(p.is_alive() for p in pool.procs))
        pool = None
    while len(_pools) >= MAX_POOLS:
        _pools.pop(next(iter(_pools))).close()
    pool = pool or _Pool(world)
    try:
        results, errors = pool.run(next(_task_ids), fn, args, timeout, backend)
    except BaseException:  # Ctrl-C or an unpicklable argument: these ranks cannot be trusted any more
        pool.close(kill=True)
        raise
    if errors:
        pool.close(kill=True)  # a rank may still wait in a collective: never reuse these processes
        raise RuntimeError("distributed worker failed\n" + "\n".join(errors))
    _pools[world] = pool
    return [results[r] for r in range(world)]
