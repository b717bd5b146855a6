r"""Where the wall time of one ``pmz convert`` goes, measured inside the process (issue 40).

``tools/bench_convert.py --profile DIRECTION`` runs this on a checkpoint it set up (after one
untimed warm-up conversion, so the source is in the page cache); alone::

    python tools/convert_profile.py SRC OUT --to hf [other pmz convert arguments]

It runs ``converters.cli.main`` in this process with instruments put around module attributes (no
converter file changes, nothing is imported that the conversion would not import) and prints:

- stages (wall time, in order): interpreter start-up and imports before the CLI, the temp dir,
  opening and validating the source (the format's validating reader), planning, creating the
  output files and writing their headers, copying (the worker threads), index / config /
  tokenizer, the rename into place;
- system calls made through ``os`` (``preadv``, ``pwrite``, ``pwritev``, ``copy_file_range``,
  ``sendfile``, ``fsync``...): calls, bytes, seconds inside them (summed over threads) and a
  histogram of sizes; per worker thread: seconds in tasks, in system calls, and waiting for an
  output file's write lock (``io.write_lock``: one file's writes are serialized);
- cProfile of the worker threads (one profiler per thread, merged) and of the main thread;
- the process's CPU time (user / system), page faults, ``/proc/self/io`` (``rchar``/``wchar``
  count page-cache reads and writes) and ``/proc/vmstat`` deltas (pages dirtied, written back).

The instruments cost ~1-2 us per system call (a Python wrapper) and cProfile's per-call cost:
compare stage times with each other, not with unprofiled runs (``bench_convert`` prints those).
``PMZ_PROFILE_NO_CPROFILE=1`` leaves cProfile out (stages and system calls only).
"""

from __future__ import annotations

import cProfile
import functools
import io
import os
import pstats
import resource
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

T_START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
SYSCALLS = ("preadv", "pread", "pwrite", "pwritev", "copy_file_range", "sendfile", "fsync", "fdatasync", "write",
            "read", "rename", "replace", "posix_fadvise", "ftruncate", "truncate", "open")
VMSTAT = ("nr_dirtied", "nr_written", "pgfault", "pgmajfault", "pgpgin", "pgpgout", "thp_fault_alloc")


def process_age_s() -> float:
    """Seconds since this process started (``/proc/self/stat`` start time, clock ticks since boot)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def read_kv(path: str, keys=None) -> dict[str, int]:
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            k, _, v = line.replace(":", " ").partition(" ")
            if keys is None or k in keys:
                out[k] = int(v.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


class Recorder:
    def __init__(self) -> None:
        self.stages: list[tuple[str, float, float, float]] = []  # (name, start from T_START, wall s, CPU s)
        self.calls = defaultdict(lambda: [0, 0, 0.0])  # (thread, call) -> [calls, bytes, seconds]
        self.sizes = defaultdict(lambda: defaultdict(int))  # call -> log2 size bucket -> calls
        self.lock_wait = defaultdict(lambda: [0, 0.0])  # thread -> [acquisitions, seconds waited]
        self.task_time = defaultdict(lambda: [0, 0.0])  # thread -> [tasks, seconds]
        self.profiles: list[cProfile.Profile] = []
        self.local = threading.local()

    # --- stages
    def stage(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*a, **k):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                self.stages.append((name, t0 - T_START, time.perf_counter() - t0, time.process_time() - c0))
        return timed

    # --- system calls
    def syscall(self, name: str, fn):
        calls, sizes = self.calls, self.sizes

        def counted(*a, **k):
            t0 = time.perf_counter()
            r = fn(*a, **k)
            dt = time.perf_counter() - t0
            n = r if isinstance(r, int) and name not in ("open", "fsync", "fdatasync") else 0
            if name in ("pread", "read") and isinstance(r, bytes):
                n = len(r)
            rec = calls[(threading.current_thread().name, name)]
            rec[0] += 1
            rec[1] += n
            rec[2] += dt
            sizes[name][max(0, n).bit_length()] += 1
            return r
        return counted

    # --- worker threads
    def task_entry(self, fn):
        prof_on = os.environ.get("PMZ_PROFILE_NO_CPROFILE") != "1"

        def entry(payload):
            me = threading.current_thread()
            prof = getattr(self.local, "prof", None)
            if prof is None and prof_on and me is not threading.main_thread():
                prof = self.local.prof = cProfile.Profile()
                self.profiles.append(prof)
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            try:
                return fn(payload)
            finally:
                if prof is not None:
                    prof.disable()
                rec = self.task_time[me.name]
                rec[0] += 1
                rec[1] += time.perf_counter() - t0
        return entry

    def timed_lock(self, make):
        waits = self.lock_wait

        class TimedLock:
            def __init__(self, lock):
                self.lock = lock

            def __enter__(self):
                t0 = time.perf_counter()
                self.lock.acquire()
                rec = waits[threading.current_thread().name]
                rec[0] += 1
                rec[1] += time.perf_counter() - t0
                return self

            def __exit__(self, *exc):
                self.lock.release()

            def acquire(self, *a, **k):
                return self.lock.acquire(*a, **k)

            def release(self):
                self.lock.release()

        @functools.wraps(make)
        def wrapped(path):
            return TimedLock(make(path))
        return wrapped


def instrument(rec: Recorder) -> None:
    """Wrap the stages, the system calls and the worker threads' task entry (module attributes)."""
    import importlib

    for name in SYSCALLS:
        if hasattr(os, name):
            setattr(os, name, rec.syscall(name, getattr(os, name)))
    stages = [
        ("converters.runtime.staging", "Staging.__enter__", "temp dir (create, lock, stale ones)"),
        ("converters.runtime.staging", "Staging._publish", "rename into place"),
        ("converters.copy_path.sources", "open_raw_source", "open + validate source (reader)"),
        ("converters.copy_path.hf", "plan_hf_files", "plan HF files"),
        ("converters.copy_path.hf", "hf_tasks", "create files, write headers, cut tasks"),
        ("converters.copy_path.hf", "preallocate", "preallocate (fallocate; the sum over files)"),
        ("converters.copy_path.hf", "run_tasks", "copy bytes (worker threads)"),
        ("converters.copy_path.hf", "write_index", "write index"),
        ("converters.copy_path.hf", "write_config_dir", "config, generation config, tokenizer"),
        ("converters.copy_path.hf", "read_hf_config", "read HF config"),
        ("converters.copy_path.megatron", "write_megatron_by_copy", "Megatron writer (all of it)"),
        ("converters.copy_path.megatron", "plan_copy_target", "plan Megatron target"),
        ("converters.copy_path.vllm", "write_vllm_by_copy", "vLLM writer (all of it)"),
        ("converters.copy_path.vllm", "plan_vllm_target", "plan vLLM target"),
        ("converters.engine", "_convert_by_copy", "copy path (all of it)"),
    ]
    for module, attr, label in stages:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        owner, _, name = attr.rpartition(".")
        target = getattr(mod, owner) if owner else mod
        if hasattr(target, name):
            setattr(target, name, rec.stage(label, getattr(target, name)))
    from converters.runtime import tasks

    tasks._task_entry = rec.task_entry(tasks._task_entry)
    try:
        from converters.copy_path import io as cio

        cio.write_lock = rec.timed_lock(cio.write_lock)
    except ImportError:
        pass


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def report(rec: Recorder, t_imports: float, age0: float, t_total: float, before: dict, out=sys.stdout) -> None:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    p = functools.partial(print, file=out)
    p(f"\n-- stages: start (s from this process's start), wall s, CPU s of the whole process meanwhile "
      f"(interpreter {age0:.3f} s before the profiler's first line, then imports of the CLI {t_imports:.3f} s, "
      f"CPU by then {before['cpu']:.3f} s)")
    merged: dict[str, list] = {}  # a stage met several times (one per file): first start, sums, count
    for name, start, dt, cpu in sorted(rec.stages, key=lambda s: s[1]):
        m = merged.setdefault(name, [start, 0.0, 0.0, 0])
        m[1:] = [m[1] + dt, m[2] + cpu, m[3] + 1]
    for name, (start, dt, cpu, n) in merged.items():
        p(f"  {start + age0:7.3f} +{dt:7.3f} cpu {cpu:6.3f}  {name}" + (f" (x{n})" if n > 1 else ""))
    p(f"  {t_total + age0:7.3f}           end of main (whole process ~{t_total + age0:.3f} s)")
    p(f"\n-- CPU: user {ru.ru_utime:.3f} s, system {ru.ru_stime:.3f} s; minor faults {ru.ru_minflt}, major "
      f"{ru.ru_majflt}; voluntary / involuntary context switches {ru.ru_nvcsw} / {ru.ru_nivcsw}")
    pio = read_kv("/proc/self/io")
    p("   /proc/self/io: " + ", ".join(f"{k} {human(pio.get(k, 0) - before['io'].get(k, 0))}"
                                       for k in ("rchar", "wchar", "read_bytes", "write_bytes")))
    vm = read_kv("/proc/vmstat", VMSTAT)
    p("   /proc/vmstat (whole machine): " + ", ".join(f"{k} +{vm.get(k, 0) - before['vm'].get(k, 0)}" for k in VMSTAT))
    p("\n-- system calls through os (all threads): calls, bytes, s inside, mean size; sizes (log2 buckets)")
    by_call = defaultdict(lambda: [0, 0, 0.0])
    for (_, name), (c, b, s) in rec.calls.items():
        agg = by_call[name]
        agg[0] += c
        agg[1] += b
        agg[2] += s
    for name, (c, b, s) in sorted(by_call.items(), key=lambda kv: -kv[1][2]):
        hist = ", ".join(f"<{human(2 ** k)}: {v}" for k, v in sorted(rec.sizes[name].items()) if v)
        p(f"  {name:<16} {c:7d} calls {human(b):>10} {s:7.3f} s  mean {human(b / max(1, c)):>10}  [{hist}]")
    p("\n-- per thread: tasks, s in tasks, s in system calls (by call), write-lock waits")
    threads = sorted({t for t, _ in rec.calls} | set(rec.task_time) | set(rec.lock_wait))
    for t in threads:
        tasks_n, tasks_s = rec.task_time.get(t, (0, 0.0))
        sys_s = {n: v[2] for (tt, n), v in rec.calls.items() if tt == t}
        waits = rec.lock_wait.get(t, (0, 0.0))
        p(f"  {t:<12} {tasks_n:4d} tasks {tasks_s:7.3f} s; syscalls {sum(sys_s.values()):7.3f} s ("
          + ", ".join(f"{n} {s:.3f}" for n, s in sorted(sys_s.items(), key=lambda kv: -kv[1]) if s >= 0.001)
          + f"); write lock {waits[0]} x, waited {waits[1]:.3f} s")
    if rec.profiles:
        s = io.StringIO()
        stats = pstats.Stats(rec.profiles[0], stream=s)
        for prof in rec.profiles[1:]:
            stats.add(prof)
        stats.sort_stats("tottime").print_stats(18)
        p("\n-- cProfile, worker threads merged (by own time)")
        p("\n".join(line for line in s.getvalue().splitlines()[4:] if line.strip()))


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    age0 = process_age_s() - (time.perf_counter() - T_START)
    before = {"io": read_kv("/proc/self/io"), "vm": read_kv("/proc/vmstat", VMSTAT)}
    t0 = time.perf_counter()
    from converters import (
        cli,
        engine,  # noqa: F401  (the CLI imports it on a convert: here, to instrument it)
    )

    t_imports = time.perf_counter() - t0
    before["cpu"] = time.process_time()
    rec = Recorder()
    instrument(rec)
    main_prof = cProfile.Profile() if os.environ.get("PMZ_PROFILE_NO_CPROFILE") != "1" else None
    if main_prof is not None:
        main_prof.enable()
    try:
        rc = cli.main(["convert", *argv, "--quiet"])
    finally:
        if main_prof is not None:
            main_prof.disable()
    t_total = time.perf_counter() - T_START
    report(rec, t_imports, age0, t_total, before)
    if main_prof is not None:
        s = io.StringIO()
        pstats.Stats(main_prof, stream=s).sort_stats("cumulative").print_stats(22)
        print("\n-- cProfile, main thread (by cumulative time)")
        print("\n".join(line for line in s.getvalue().splitlines()[4:] if line.strip()))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
