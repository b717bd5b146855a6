"""Running conversion tasks in worker threads or processes (the lowest converter layer: nothing here
imports other converter modules, so readers, writers and the engine can all point down to it).

Threads (``threads=True``: the copy path, whose tasks are system calls that release the GIL --
``preadv``, ``pwrite``, ``pwritev``) live and die with the process: a killed conversion
leaves nothing writing into its temp dir. They block SIGINT/SIGTERM, so those reach the main thread
only (also while it masks them around publishing and cleaning up); when the run stops early (an
error, Ctrl-C, SIGTERM) they stop at their next chunk (``stop_requested``) and the caller waits for
them before it removes the temp dir.

Worker processes (the torch path) die with the process that started them: on Linux each sets
``PR_SET_PDEATHSIG`` (SIGKILL when the parent dies), and everywhere each checks ``os.getppid()``
before a task, so a killed conversion leaves no process writing into its temp dir. Workers ignore
SIGINT (Ctrl-C reaches the whole process group; the parent alone handles it and terminates the
pool) and take SIGTERM's default action (the pool is terminated with it).

A write that fails in a task (disk full, file size limit, read-only file system) reaches the
caller as an ``OSError`` whose ``filename`` names the file being written, also when ``torch.save``
wrapped it in its opaque ``inline_container`` RuntimeError or safetensors in its SafetensorError
(``os_error_of``).
"""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import threading
from typing import Any, Callable, Sequence

_PARENT: int | None = None  # pid of the process that started this worker (None outside workers)
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_JOIN_TIMEOUT_S = 30.0  # how long an interrupted run waits for its threads to reach a stopping point
_local = threading.local()  # .stop: the Event of the thread-run this worker thread belongs to


class Stopped(Exception):
    """Raised inside a worker thread's task when the run is stopping (another task failed, Ctrl-C)."""


def stop_requested() -> bool:
    """True in a worker thread whose run is stopping: long tasks check it between chunks."""
    stop = getattr(_local, "stop", None)
    return stop is not None and stop.is_set()


def check_stop() -> None:
    if stop_requested():
        raise Stopped()


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit now if it already has."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass  # the getppid() checks below and before each task still apply
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _worker_init(parent: int) -> None:
    global _PARENT
    _PARENT = parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked by the parent around the fork
    _die_with_parent(parent)


def _task_entry(payload: tuple) -> Any:
    fn, args = payload
    if _PARENT is not None and os.getppid() != _PARENT:
        os._exit(1)  # orphaned: nobody will use what this task writes
    if _PARENT is not None and "torch" in sys.modules:  # one thread per worker process (not in threads)
        sys.modules["torch"].set_num_threads(1)
    try:
        return fn(*args)
    except Exception as exc:
        # The traceback (which names the file being written) and torch's exception chain do not
        # survive the trip to the parent: resolve them here.
        err = os_error_of(exc)
        if err is None or err is exc:
            raise
        raise err from None


def progress_bar(total: int, desc: str, unit: str):
    """A tqdm bar on stderr when stderr is a terminal, else None. tqdm (``disable=None``) shows nothing
    off a terminal anyway; not importing it there saves ~40 ms of start-up (it imports
    ``importlib.metadata`` for its version), which is a tenth of a 1 GB conversion's wall time."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)


def run_tasks(tasks: Sequence[tuple[Callable, tuple]], workers: int, desc: str, progress: bool, *,
              threads: bool = False) -> list:
    """Run ``fn(*args)`` for each task, in ``workers`` threads (``threads=True``) or worker processes
    when ``workers > 1``; results in task order."""
    bar = progress_bar(len(tasks), desc, "task") if progress else None
    results = []
    try:
        if workers <= 1 or len(tasks) <= 1:
            for fn, args in tasks:
                results.append(fn(*args))
                if bar:
                    bar.update(1)
        elif threads:
            results = _run_in_threads(tasks, min(workers, len(tasks)), bar)
        else:
            import multiprocessing as mp

            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            # Workers start with SIGINT/SIGTERM blocked until their initializer has set their own
            # handlers: a Ctrl-C during the fork must not raise KeyboardInterrupt inside a worker.
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
            try:
                pool = mp.get_context(method).Pool(min(workers, len(tasks)), initializer=_worker_init,
                                                   initargs=(os.getpid(),))
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            with pool:  # leaving it (error, Ctrl-C, SIGTERM) terminates the workers and waits for them
                for result in pool.imap(_task_entry, tasks):
                    results.append(result)
                    if bar:
                        bar.update(1)
    finally:
        if bar:
            bar.close()
    return results


def _run_in_threads(tasks: Sequence[tuple[Callable, tuple]], n: int, bar) -> list:
    import queue

    results: list = [None] * len(tasks)
    done: queue.SimpleQueue = queue.SimpleQueue()  # (task index, exception or None)
    stop = threading.Event()
    lock = threading.Lock()
    pending = iter(range(len(tasks)))

    def work() -> None:
        _local.stop = stop
        while not stop.is_set():
            with lock:
                i = next(pending, None)
            if i is None:
                return
            try:
                results[i] = _task_entry(tasks[i])
            except Stopped:
                return
            except BaseException as exc:  # noqa: B036 - handed to the main thread, which raises it
                stop.set()
                done.put((i, exc))
                return
            done.put((i, None))

    # The threads inherit SIGINT/SIGTERM blocked: the main thread alone handles them.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        pool = [threading.Thread(target=work, name=f"pmz-copy-{k}", daemon=True) for k in range(n)]
        for t in pool:
            t.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    try:
        for _ in range(len(tasks)):
            _, exc = done.get()  # a signal interrupts the wait (KeyboardInterrupt, SIGTERM's exception)
            if exc is not None:
                raise exc
            if bar:
                bar.update(1)
    finally:
        stop.set()
        # Wait for the threads (they stop at their next chunk) so nothing writes once the caller
        # removes the temp dir; a thread stuck in a system call past the timeout is a daemon and
        # goes with the process.
        import time

        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for t in pool:
            t.join(max(0.0, deadline - time.monotonic()))
    return results


def os_error_of(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``, with ``filename`` set to the file being written when the error does
    not name one (a ``write()`` on a full disk does not): ``exc`` itself, the OSError ``torch.save``
    wrapped in a RuntimeError, or, for a RuntimeError of torch's zip writer that kept no OSError
    (``torch.save`` to a path), an OSError carrying its message; safetensors' SafetensorError with
    its "(os error N)". None for anything else."""
    err: BaseException | None = None
    if isinstance(exc, OSError):
        err = exc
    elif isinstance(exc, RuntimeError):
        seen: set[int] = set()
        cause: BaseException | None = exc
        while cause is not None and id(cause) not in seen and not isinstance(cause, OSError):
            seen.add(id(cause))
            cause = cause.__cause__ or cause.__context__
        err = cause
        if err is None and ("PytorchStreamWriter" in str(exc) or "inline_container" in str(exc)):
            err = OSError(f"torch.save failed ({' '.join(str(exc).split())})")
    elif type(exc).__name__ == "SafetensorError":  # safetensors' save_file: "I/O error: ... (os error 28)"
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is not None:
            err = OSError(int(code.group(1)), os.strerror(int(code.group(1))))
    if not isinstance(err, OSError):
        return None
    if err.filename is None:
        name = _file_being_written(exc.__traceback__) or _file_being_written(err.__traceback__)
        if name is not None:
            err.filename = name
    return err


def _file_being_written(tb) -> str | None:
    """The innermost file open for writing in a traceback's frames (a local file object, or the
    path argument of ``torch.save``)."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in list(frame.f_locals.values()):
            if isinstance(value, io.IOBase) and any(c in getattr(value, "mode", "") for c in "wax+"):
                name = getattr(value, "name", None)
                if isinstance(name, (str, bytes, os.PathLike)):
                    return os.fsdecode(name)
        code = frame.f_code
        for (module, function), argument in _WRITERS.items():
            if code.co_name == function and code.co_filename.endswith(module):
                target = frame.f_locals.get(argument)
                if isinstance(target, (str, bytes, os.PathLike)):
                    return os.fsdecode(target)
    return None


# Library functions that write a file given by path: (source file, function) -> argument naming it.
_WRITERS = {(os.path.join("torch", "serialization.py"), "save"): "f",
            (os.path.join("torch", "serialization.py"), "_save"): "f",
            (os.path.join("safetensors", "torch.py"), "save_file"): "filename",
            (os.path.join("safetensors", "numpy.py"), "save_file"): "filename"}
