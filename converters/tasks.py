"""Running conversion tasks in worker processes (the lowest converter layer: nothing here imports
other converter modules, so readers, writers and the engine can all point down to it)."""

from __future__ import annotations

import multiprocessing as mp
import sys
from typing import Any, Callable, Sequence


def _task_entry(payload: tuple) -> Any:
    fn, args = payload
    if "torch" in sys.modules:  # one thread per worker process; the copy path never loads torch
        sys.modules["torch"].set_num_threads(1)
    return fn(*args)


def run_tasks(tasks: Sequence[tuple[Callable, tuple]], workers: int, desc: str, progress: bool) -> list:
    """Run ``fn(*args)`` for each task, in worker processes when ``workers > 1``; results in task order."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(tasks), desc=desc, unit="task", file=sys.stderr, leave=False, disable=None)
    results = []
    try:
        if workers <= 1 or len(tasks) <= 1:
            for fn, args in tasks:
                results.append(fn(*args))
                if bar:
                    bar.update(1)
        else:
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            with mp.get_context(method).Pool(min(workers, len(tasks))) as pool:
                for result in pool.imap(_task_entry, tasks):
                    results.append(result)
                    if bar:
                        bar.update(1)
    finally:
        if bar:
            bar.close()
    return results
