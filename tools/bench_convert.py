r"""Conversion benchmark: a >= 1 GB Megatron legacy checkpoint (TP=2, PP=2) -> HF, against ``cp``.

What it measures
    Set-up (not timed): a synthetic Llama (or Qwen2) checkpoint is written as HF safetensors from
    random tensors generated one layer at a time (one shard per layer, so the model is never in
    memory whole), then ``convert(hf, mcore, to="megatron", tp=2, pp=2)`` makes the Megatron legacy
    checkpoint the benchmark reads; the HF source is deleted. Defaults: hidden 2048, 16 heads /
    4 KV heads, ffn 5632, 12 layers, vocab 32000, untied, bf16: 1.34 GB (1.25 GiB).

    Timed, in the same run, alternating for ``--reps`` rounds (after one untimed warm-up of each so
    that every timed run reads its source from the page cache, never from disk):
      * cp:       ``cp -r <megatron dir> <fresh dir>`` on the same filesystem (the copy is deleted);
      * convert:  ``convert(mcore, out, to="hf", workers=W, max_shard_size=S)`` for each W in
                  ``--workers`` and S in ``--shard-sizes``, each in a fresh Python child process (one
                  per measurement) whose peak RSS is ``ru_maxrss`` from ``os.wait4`` on that child
                  (largest single process of its tree), cross-checked against the child's own
                  ``VmHWM``. The orchestrating parent never imports torch: on Linux a vfork/exec
                  child starts with its parent's high-water RSS. A sampler also sums RSS (anonymous
                  vs file-backed) over the child's process tree every 50 ms.
    ``os.sync()`` runs (untimed) before every timed operation so no write-back of an earlier one
    lands inside a later one. Throughput is checkpoint bytes / wall seconds for both.

    Two conversion times are reported: the ``convert()`` call timed inside the child (headline
    ``copy_ratio``; the child imports torch and the converters first — not transformers, which the
    conversion path never imports), and the child process end to end (``copy_ratio_e2e``: interpreter start and imports,
    ~2-4 s, included). Peak RSS is given in MiB and as % of the checkpoint bytes, with the RSS the
    child had after its imports alone (the floor any conversion process pays). Targets (issue):
    conversion throughput >= 0.5x cp throughput; peak RSS <= 25% of the checkpoint. The first
    shard size (5GB, convert's default) gives one output file here, which the worker tasks fill in
    byte ranges; 500MB gives several files.
    ``--profile`` adds one cProfile'd conversion (top functions by own time).

How to run
    . .venv/bin/activate
    python tools/bench_convert.py                      # defaults: about 2.5-4 minutes on 2 cores
    python tools/bench_convert.py --shard-sizes 5GB --workers 1 --reps 2 --workdir /big/tmp --profile

    Temp data (about 3x the checkpoint at peak) goes under ``--workdir`` (default: a new dir under
    /tmp) and is deleted at the end (``--keep`` keeps it). The last line is machine-readable:
    ``copy_ratio=X copy_ratio_e2e=Y peak_rss_pct=Z best_copy_ratio=B@SIZE,wN worst_copy_ratio=...
    targets_met=yes|no`` (headline = the first shard size and workers setting: convert's defaults),
    where X, Y, Z are for the first shard size, worst over ``--workers``, and B is the best
    convert-call ratio over all settings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPY_TARGET = 0.5  # conversion throughput / cp throughput
RSS_TARGET_PCT = 25.0  # peak RSS / checkpoint bytes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workdir", default=None, help="temp data goes in a new dir under this one (default: /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the temp data")
    p.add_argument("--reps", type=int, default=3, help="timed rounds (cp, then each setting)")
    p.add_argument("--workers", default="2,1",
                   help="comma-separated convert(workers=...) settings; the first is the headline "
                        "(2 = convert()'s default, min(4, cores), on a 2-core machine)")
    p.add_argument("--shard-sizes", default="5GB,500MB",
                   help="comma-separated convert(max_shard_size=...) settings; the first (convert's default "
                        "5GB: one output file here) is the headline")
    p.add_argument("--arch", choices=("llama", "qwen2"), default="llama")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--profile", action="store_true", help="one more conversion under cProfile (first shard size, workers=1)")
    # Internal child modes (the orchestrator runs itself with these).
    p.add_argument("--_setup", nargs=2, metavar=("HF_DIR", "MCORE_DIR"), help=argparse.SUPPRESS)
    p.add_argument("--_convert", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    p.add_argument("--_nworkers", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--_profile_out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_shard", default="5GB", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------- child modes

def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child_setup(args: argparse.Namespace) -> None:
    """Synthetic HF checkpoint (layer by layer) -> Megatron legacy TP=2 PP=2 (the parent deletes the HF dir)."""
    sys.path.insert(0, str(ROOT))
    import torch
    from safetensors.torch import save_file

    from converters import convert

    hf_dir, mcore_dir = Path(args._setup[0]), Path(args._setup[1])
    hf_dir.mkdir(parents=True)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    h, nh, kv, ffn, L, V = args.hidden, args.heads, args.kv_heads, args.ffn, args.layers, args.vocab
    hd = h // nh
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.empty(shape, dtype=torch.float32).uniform_(-0.05, 0.05, generator=gen).to(dtype)

    groups = []  # callables returning one shard's tensors
    groups.append(lambda: {"model.embed_tokens.weight": rand(V, h)})
    for i in range(L):
        def layer(i=i):
            pre = f"model.layers.{i}."
            t = {pre + "self_attn.q_proj.weight": rand(nh * hd, h), pre + "self_attn.k_proj.weight": rand(kv * hd, h),
                 pre + "self_attn.v_proj.weight": rand(kv * hd, h), pre + "self_attn.o_proj.weight": rand(h, nh * hd),
                 pre + "mlp.gate_proj.weight": rand(ffn, h), pre + "mlp.up_proj.weight": rand(ffn, h),
                 pre + "mlp.down_proj.weight": rand(h, ffn),
                 pre + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                 pre + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)}
            if args.arch == "qwen2":
                t.update({pre + "self_attn.q_proj.bias": rand(nh * hd), pre + "self_attn.k_proj.bias": rand(kv * hd),
                          pre + "self_attn.v_proj.bias": rand(kv * hd)})
            return t
        groups.append(layer)
    groups.append(lambda: {"model.norm.weight": torch.ones(h, dtype=dtype), "lm_head.weight": rand(V, h)})

    n = len(groups)
    weight_map, total = {}, 0
    for k, make in enumerate(groups):
        tensors = make()
        name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(hf_dir / name), metadata={"format": "pt"})
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
        del tensors
    (hf_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    common = dict(vocab_size=V, hidden_size=h, intermediate_size=ffn, num_hidden_layers=L, num_attention_heads=nh,
                  num_key_value_heads=kv, max_position_embeddings=4096, tie_word_embeddings=False)
    if args.arch == "qwen2":
        from transformers import Qwen2Config as Config
    else:
        from transformers import LlamaConfig as Config
    config = Config(**common)
    config.dtype = dtype
    config.save_pretrained(str(hf_dir))
    t0 = time.perf_counter()
    convert(str(hf_dir), str(mcore_dir), to="megatron", tp=2, pp=2)
    print(json.dumps({"hf_bytes": total, "setup_convert_s": time.perf_counter() - t0}))


def child_convert(args: argparse.Namespace) -> None:
    """One timed Megatron -> HF conversion; prints a JSON line with timings and RSS."""
    t_start = time.perf_counter()
    sys.path.insert(0, str(ROOT))
    # Everything convert() would import lazily is imported here, so the timed call is conversion work
    # only (the e2e figures include it). The converters do not import transformers.
    import torch  # noqa: F401

    from converters import convert
    import converters.hf  # noqa: F401
    import converters.megatron_legacy  # noqa: F401
    import models.llama  # noqa: F401
    import models.qwen2  # noqa: F401

    t_import = time.perf_counter() - t_start
    hwm_import = _status_kb("VmHWM")
    src, dst = args._convert
    prof = None
    if args._profile_out:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    convert(src, dst, to="hf", workers=args._nworkers, max_shard_size=args._shard)
    t_convert = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
        prof.dump_stats(args._profile_out)
    print(json.dumps({"t_import": t_import, "t_convert": t_convert, "hwm_import_kb": hwm_import,
                      "hwm_kb": _status_kb("VmHWM")}))


# --------------------------------------------------------------------------------------------- orchestrator

def _tree_pids(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return out


class TreeSampler(threading.Thread):
    """Peak of the summed VmRSS / RssAnon / RssFile of a process tree, sampled every ``interval`` s."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.stop = threading.Event()
        self.peak = {"rss": 0, "anon": 0, "file": 0, "procs": 0}

    def run(self) -> None:
        while not self.stop.is_set():
            tot = {"rss": 0, "anon": 0, "file": 0}
            pids = _tree_pids(self.pid)
            for p in pids:
                try:
                    for line in Path(f"/proc/{p}/status").read_text().splitlines():
                        key = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file"}.get(line.split(":")[0] + ":")
                        if key:
                            tot[key] += int(line.split()[1])
                except (FileNotFoundError, ProcessLookupError):
                    pass
            if tot["rss"] > self.peak["rss"]:
                self.peak = {**tot, "procs": len(pids)}
            self.stop.wait(self.interval)


def run_child(cmd: list[str], sample: bool = False) -> dict:
    """Run ``cmd``; wall time, its own rusage (os.wait4) and stdout. Raises on failure."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=str(ROOT))
        sampler = TreeSampler(proc.pid) if sample else None
        if sampler:
            sampler.start()
        _, status, ru = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if sampler:
            sampler.stop.set()
            sampler.join()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])}... failed (exit {proc.returncode}):\n{stderr[-4000:]}")
    return {"wall": wall, "maxrss_kb": ru.ru_maxrss, "stdout": stdout, "stderr": stderr,
            "tree": sampler.peak if sampler else None}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def remove(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


def mib(nbytes: float) -> float:
    return nbytes / 2**20


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._setup:
        child_setup(args)
        return 0
    if args._convert:
        child_convert(args)
        return 0

    t_script = time.perf_counter()
    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    shard_sizes = [x.strip() for x in args.shard_sizes.split(",") if x.strip()]
    settings = [(size, w) for size in shard_sizes for w in workers]  # first shard size = headline
    base = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_convert_", dir=base))
    me = [sys.executable, str(Path(__file__).resolve())]
    shape = ["--arch", args.arch, "--dtype", args.dtype, "--hidden", str(args.hidden), "--heads", str(args.heads),
             "--kv-heads", str(args.kv_heads), "--ffn", str(args.ffn), "--layers", str(args.layers),
             "--vocab", str(args.vocab)]
    hf_dir, mcore = work / "hf_src", work / "mcore"
    try:
        print(f"workdir {work}; {os.cpu_count()} CPUs; python {sys.version.split()[0]}", flush=True)
        print(f"set-up: synthetic {args.arch} {args.dtype} hidden={args.hidden} heads={args.heads}/{args.kv_heads} "
              f"ffn={args.ffn} layers={args.layers} vocab={args.vocab} (untied) -> HF -> Megatron legacy TP=2 PP=2 "
              f"(not timed) ...", flush=True)
        t0 = time.perf_counter()
        setup = run_child(me + shape + ["--_setup", str(hf_dir), str(mcore)])
        info = json.loads(setup["stdout"].strip().splitlines()[-1])
        remove(hf_dir)
        ckpt = dir_bytes(mcore)
        rank_files = sorted(str(p.relative_to(mcore)) for p in mcore.rglob("model_optim_rng.pt"))
        print(f"  done in {time.perf_counter() - t0:.1f} s (HF->Megatron convert {info['setup_convert_s']:.1f} s); "
              f"checkpoint {ckpt:,} bytes = {ckpt / 1e9:.3f} GB = {mib(ckpt) / 1024:.3f} GiB in "
              f"{len(rank_files)} rank files", flush=True)
        if ckpt < 10**9:
            print("  WARNING: checkpoint is below 1 GB; raise --layers/--hidden for the issue's setting")

        def do_cp() -> float:
            dst = work / "cp_copy"
            os.sync()
            t = time.perf_counter()
            subprocess.run(["cp", "-r", str(mcore), str(dst)], check=True)
            t = time.perf_counter() - t
            remove(dst)
            return t

        def do_convert(size: str, w: int, profile_out: str | None = None) -> dict:
            dst = work / "hf_out"
            os.sync()
            cmd = me + ["--_convert", str(mcore), str(dst), "--_nworkers", str(w), "--_shard", size]
            if profile_out:
                cmd += ["--_profile_out", profile_out]
            r = run_child(cmd, sample=profile_out is None)
            r.update(json.loads(r["stdout"].strip().splitlines()[-1]))
            r["out_bytes"] = dir_bytes(dst)
            r["out_files"] = len(list(dst.glob("*.safetensors")))
            remove(dst)
            return r

        print("warm-up (untimed): one cp and one conversion, so every timed run reads the source from the page "
              "cache (it was just written, so it is cached anyway)", flush=True)
        wcp = do_cp()
        wcv = do_convert(*settings[0])
        print(f"  warm-up cp {wcp:.2f} s, convert {wcv['t_convert']:.2f} s (process {wcv['wall']:.2f} s); HF output "
              f"{wcv['out_bytes']:,} bytes", flush=True)

        cps: list[float] = []
        convs: dict[tuple[str, int], list[dict]] = {s: [] for s in settings}
        for rep in range(args.reps):
            cps.append(do_cp())
            line = f"round {rep + 1}/{args.reps}: cp {cps[-1]:.2f} s"
            for size, w in settings:
                r = do_convert(size, w)
                convs[(size, w)].append(r)
                line += f" | {size} w={w}: {r['t_convert']:.2f} s ({r['wall']:.2f} s e2e) {r['maxrss_kb'] / 1024:.0f} MiB"
            print(line, flush=True)

        t_cp = statistics.median(cps)
        print()
        print(f"checkpoint bytes             {ckpt:,} ({mib(ckpt):.0f} MiB), Megatron legacy TP=2 PP=2, {args.dtype}")
        print(f"cp -r (median of {len(cps)})       {t_cp:.2f} s = {ckpt / t_cp / 1e6:.0f} MB/s   "
              f"[all: {', '.join(f'{t:.2f}' for t in cps)}]")
        print("page cache: warm for both (source cached after the warm-up; outputs land in the page cache and are "
              "deleted; os.sync() before each timed step). Times are medians; the VM's speed drifts, so cp and "
              "conversions alternate and ratios use medians of the same rounds.")
        results: dict[tuple[str, int], tuple[float, float, float]] = {}
        for size, w in settings:
            rs = convs[(size, w)]
            t_conv = statistics.median(r["t_convert"] for r in rs)
            t_proc = statistics.median(r["wall"] for r in rs)
            t_imp = statistics.median(r["t_import"] for r in rs)
            peak_kb = max(r["maxrss_kb"] for r in rs)
            hwm_kb = max(r["hwm_kb"] for r in rs)
            imp_kb = max(r["hwm_import_kb"] for r in rs)
            tree = max((r["tree"] for r in rs), key=lambda t: t["rss"])
            ratio, ratio_e2e = t_cp / t_conv, t_cp / t_proc
            pct = 100 * peak_kb * 1024 / ckpt
            note = "" if w > 1 and rs[0]["out_files"] == 1 else ""
            print(f"\nmax_shard_size={size} workers={w} (HF output: {rs[0]['out_files']} safetensors file(s){note})")
            print(f"  convert() call (median)    {t_conv:.2f} s = {ckpt / t_conv / 1e6:.0f} MB/s   "
                  f"[all: {', '.join(format(r['t_convert'], '.2f') for r in rs)}]")
            print(f"  child process end to end   {t_proc:.2f} s = {ckpt / t_proc / 1e6:.0f} MB/s   "
                  f"(of which imports {t_imp:.2f} s)")
            print(f"  throughput vs cp           {ratio:.2f}x (convert call), {ratio_e2e:.2f}x (end to end)   "
                  f"target >= {COPY_TARGET}x: {'met' if ratio >= COPY_TARGET else 'MISSED'}"
                  f"{'' if ratio_e2e >= COPY_TARGET else ' (end to end: MISSED)'}")
            print(f"  peak RSS (wait4 ru_maxrss) {peak_kb / 1024:.0f} MiB = {pct:.1f}% of checkpoint   "
                  f"target <= {RSS_TARGET_PCT:.0f}%: {'met' if pct <= RSS_TARGET_PCT else 'MISSED'}")
            print(f"    largest single process; the conversion child's own VmHWM {hwm_kb / 1024:.0f} MiB. After its "
                  f"imports alone: {imp_kb / 1024:.0f} MiB = {100 * imp_kb * 1024 / ckpt:.1f}% of checkpoint; the "
                  f"conversion adds {(peak_kb - imp_kb) / 1024:.0f} MiB = {100 * (peak_kb - imp_kb) * 1024 / ckpt:.1f}%")
            print(f"    sampled process-tree peak: {tree['rss'] / 1024:.0f} MiB summed over {tree['procs']} process(es) "
                  f"(anon {tree['anon'] / 1024:.0f} MiB, file-backed incl. mmap'd source {tree['file'] / 1024:.0f} MiB"
                  f"{'; forked workers share pages, counted once per process' if tree['procs'] > 1 else ''})")
            results[(size, w)] = (ratio, ratio_e2e, pct)

        if args.profile:
            prof = work / "convert.prof"
            r = do_convert(shard_sizes[0], 1, str(prof))
            import pstats

            print(f"\ncProfile of one conversion (max_shard_size={shard_sizes[0]}, workers=1; convert "
                  f"{r['t_convert']:.2f} s under the profiler):")
            pstats.Stats(str(prof)).sort_stats("tottime").print_stats(12)

        # headline: the first setting (convert's defaults: first shard size, first workers value)
        ratio, ratio_e2e, pct = results[(shard_sizes[0], workers[0])][:3]
        best = max(results, key=lambda k: results[k][0])
        worst = min(results, key=lambda k: results[k][0])
        met = ratio >= COPY_TARGET and pct <= RSS_TARGET_PCT
        print(f"\nscript wall time {time.perf_counter() - t_script:.0f} s")
        print(f"copy_ratio={ratio:.2f} copy_ratio_e2e={ratio_e2e:.2f} peak_rss_pct={pct:.1f} "
              f"best_copy_ratio={results[best][0]:.2f}@{best[0]},w{best[1]} "
              f"worst_copy_ratio={results[worst][0]:.2f}@{worst[0]},w{worst[1]} targets_met={'yes' if met else 'no'}")
        return 0
    finally:
        if args.keep:
            print(f"(kept {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
