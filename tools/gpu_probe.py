"""Where a training step's time goes on one GPU, ours against transformers, in one process: the
GPU's idle share of a step, every host-device sync (``torch.cuda.set_sync_debug_mode``) with the
project line that asked for it, the CPU ops that cost the most host time, forward / backward /
optimizer split, and ours with each fused path switched off (``PMZ_FUSED=0``,
``PMZ_ATTENTION_KERNEL=torch``), the A/B that says what each dispatch is worth.

    python tools/gpu_probe.py --setup qwen2-1.5b --shape 4x1024        # on a CUDA machine
    .venv/bin/python tools/gpu_probe.py --smoke                       # CPU, tiny: checks the script

Written for issue 42's first GPU session, where ours ran 153 ms a step for 104 ms of kernels
(transformers: 148 for 120): the gap is host time, and this says whose.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.bench_gpu_models import build, shape_of  # noqa: E402

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize")


def _project_frame(stack) -> str:
    """The innermost frame of this project's code (not this script), as ``path:line name``."""
    for frame in reversed(stack):
        path = Path(frame.filename)
        if str(path).startswith(str(ROOT)) and path.name != Path(__file__).name and ".gpu-site" not in str(path):
            return f"{path.relative_to(ROOT)}:{frame.lineno} {frame.name}"
    for frame in reversed(stack):  # else the innermost library frame
        if "warnings" not in frame.filename and Path(frame.filename).name != Path(__file__).name:
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return "?"


def sync_sites(step, device) -> collections.Counter:
    """Each host-device sync of one step, counted by the line of code that asked for it."""
    import torch

    sites: collections.Counter = collections.Counter()
    if device.type != "cuda":
        return sites
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message).splitlines()[0][:70]
        sites[f"{_project_frame(traceback.extract_stack()[:-1])}  [{text}]"] += 1

    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = previous
    return sites


def timed(fn, sync, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def profile_step(step, device, rows: int) -> list[str]:
    """Wall time, GPU busy time, sync-type runtime calls and the top host ops of one step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t
    events = prof.key_averages()
    busy = sum(getattr(e, "self_device_time_total", 0.0) or 0.0 for e in events
               if cuda and e.device_type.name == "CUDA")
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                        "cudaLaunchKernelExC"))
    out = [f"profiled step: wall {wall * 1e3:.1f} ms (profiler on), GPU kernels {busy / 1e3:.1f} ms, "
           f"kernel launches {launches}"]
    out += [f"  {e.key}: x{e.count}, {e.self_cpu_time_total / 1e3:.1f} ms host" for e in events if e.key in SYNC_OPS]
    host = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    out.append("  top host ops by self CPU time:")
    out += [f"    {e.self_cpu_time_total / 1e3:8.2f} ms x{e.count:<5d} {e.key[:100]}" for e in host[:rows]]
    return out


def probe(variant: str, args, device, dtype) -> None:
    import torch

    seqs, seq_len = (int(x) for x in args.shape.split("x"))
    shape = shape_of(args.setup, args.smoke)
    torch.manual_seed(0)
    model, run, info = build(variant, args.setup, shape, seqs, seq_len, device, dtype)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                            fused=device.type == "cuda")  # as tools/bench_gpu.py
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    state = {}

    def forward():
        opt.zero_grad(set_to_none=True)
        state["loss"] = run()

    def backward():
        state["loss"].backward()

    def step():
        forward()
        backward()
        opt.step()
        return float(state["loss"].detach())

    print(f"== {variant} ({info}), {args.setup} {args.shape}", flush=True)
    for _ in range(args.warmup):
        step()
    sync()
    base = timed(step, sync, args.steps)
    print(f"  step {base * 1e3:.1f} ms ({seqs * seq_len / base:.0f} tokens/s), value {step():.4f}", flush=True)
    forward()
    sync()
    t = time.perf_counter()
    forward()
    sync()
    t_fwd = time.perf_counter() - t
    t = time.perf_counter()
    backward()
    sync()
    t_bwd = time.perf_counter() - t
    t = time.perf_counter()
    opt.step()
    sync()
    print(f"  split: forward {t_fwd * 1e3:.1f} ms, backward {t_bwd * 1e3:.1f} ms, "
          f"optimizer {(time.perf_counter() - t) * 1e3:.1f} ms", flush=True)
    sites = sync_sites(step, device)
    print(f"  host-device syncs in one step: {sum(sites.values())}", flush=True)
    for site, n in sites.most_common(args.rows):
        print(f"    x{n:<4d} {site}")
    for line in profile_step(step, device, args.rows):
        print(f"  {line}", flush=True)
    if variant.startswith("ours"):
        for env, value in (("PMZ_FUSED", "0"), ("PMZ_ATTENTION_KERNEL", "torch")):
            old = os.environ.get(env)
            os.environ[env] = value
            try:
                step()
                sync()
                t = timed(step, sync, args.steps)
                print(f"  with {env}={value}: step {t * 1e3:.1f} ms ({base / t:.2f}x the default's speed)",
                      flush=True)
            except Exception as e:  # one path failing must not hide the others' figures
                print(f"  with {env}={value}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            finally:
                os.environ.pop(env) if old is None else os.environ.__setitem__(env, old)


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", default="qwen2-1.5b")
    p.add_argument("--shape", default="4x1024")
    p.add_argument("--variants", default="ours,hf")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU, fp32: checks the script runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.steps, args.warmup = "2x16", 2, 1
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    for variant in args.variants.split(","):
        try:
            probe(variant, args, device, dtype)
        except Exception as e:
            print(f"== {variant} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        if device.type == "cuda":  # the last variant's model is gone with its frame
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
