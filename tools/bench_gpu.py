"""Throughput on one GPU: ours (eager and ``compile=True``) against transformers (its fastest
attention here: flash_attention_2 where flash-attn is installed, else sdpa; ``hf-liger``: the same with
Liger-Kernel's ``apply_liger_kernel_to_<family>`` patch, what users pick instead) and megatron-core's
GPTModel (local spec, plain install) on the same GPU, in the same run.

    .venv/bin/python tools/bench_gpu.py                        # every set-up at 4x1024 and 8x2048
    .venv/bin/python tools/bench_gpu.py --setup qwen3-moe --shape 4x1024 --profile
    .venv/bin/python tools/bench_gpu.py --smoke                # tiny shapes on CPU: checks the script runs

Set-ups (tools/bench_gpu_models.py): ``qwen2-1.5b``, ``qwen3-8b-cut`` (8 of 36 layers),
``qwen3-moe`` (Qwen3-30B-A3B-shaped, 4 of 48 layers; transformers with grouped_mm experts) - one
training step = forward + backward + AdamW step, bf16 - and ``rl-logprob`` (Qwen2-1.5B shape,
forward-only per-token log-probs). Shapes ``SEQSxLEN``: sequences of equal length per step, packed
(``cu_seqlens``) for ours and for transformers' flash_attention_2, a ``[SEQS, LEN]`` batch for sdpa
and megatron-core (the same attention work). Every variant runs in a process of its own (peak
memory is that variant's alone) with the same random weights; ``--warmup`` steps (compilation
included) are not timed, then the median of ``--steps``. Every variant's optimizer is AdamW with
``fused=True`` on CUDA (what a GPU trainer runs; the foreach default took 25.7 of a 125.6 ms step of ours
in the first H200 probe, tools/gpu_probe.py).

MFU = model FLOPs per second / the GPU's peak dense bf16 FLOP/s (``--peak-tflops``; default from the
device name: H100/H200 989). Model FLOPs: ``bench_gpu_models.model_flops_per_token``. ``--profile``
prints the top CUDA kernels of one step of ours and transformers (torch.profiler; CPU ops in
``--smoke``). The attention kernel ours chose (``PMZ_ATTENTION_KERNEL`` overrides it) is printed per
line. Figures go to docs/benchmarks.md; never claim a figure this script did not print on the named GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.bench_gpu_models import FORWARD_ONLY, SETUPS, build, model_flops_per_token, shape_of  # noqa: E402

VARIANTS = ("ours", "ours-compiled", "hf", "hf-liger", "megatron")
SHAPES = ("4x1024", "8x2048")
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
PROFILE_ROWS = 15


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (fp32): the script's own check")
    p.add_argument("--setup", default=",".join(SETUPS), help=f"comma list of {', '.join(SETUPS)}")
    p.add_argument("--shape", default=",".join(SHAPES), help="comma list of SEQSxLEN (default: 4x1024,8x2048)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--profile", action="store_true", help="top CUDA kernels of one step, ours and transformers")
    p.add_argument("--timeout", type=int, default=900, help="seconds per variant process")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant in this process
    args = p.parse_args(argv)
    if args.smoke and args.shape == ",".join(SHAPES):
        args.shape = "2x16"
    if args.smoke:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    return args


def parse_shape(text: str) -> tuple[int, int]:
    seqs, length = text.lower().split("x")
    return int(seqs), int(length)


def _profile(step, device) -> list[str]:
    """The top ``PROFILE_ROWS`` kernels of one step (CUDA kernels on a GPU, CPU ops on CPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = []
    total = 0.0
    for ev in prof.key_averages():
        t = getattr(ev, key, 0.0) or 0.0
        if cuda and ev.device_type.name != "CUDA":
            continue
        total += t
        rows.append((t, ev.count, ev.key))
    rows.sort(reverse=True)
    out = [f"one step: {total / 1e3:.1f} ms of {'CUDA kernels' if cuda else 'CPU ops (self)'}"]
    out += [f"{t / 1e3:9.2f} ms {100 * t / max(total, 1e-9):5.1f}% x{n:<4d} {name[:110]}"
            for t, n, name in rows[:PROFILE_ROWS]]
    return out


def run_variant(variant: str, setup: str, seqs: int, seq_len: int, args) -> dict:
    import torch

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shape = shape_of(setup, args.smoke)
    forward_only = setup in FORWARD_ONLY
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, run, info = build(variant, setup, shape, seqs, seq_len, device, dtype)
    # progress on stderr (streamed to the caller's log): a variant cut by its timeout shows where it was
    print(f"    [{variant}] built in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    opt = None if forward_only else torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                                                   fused=device.type == "cuda")  # every variant alike

    def step() -> float:
        if forward_only:
            with torch.no_grad():
                out = run()
            return float(out.float().mean())
        opt.zero_grad(set_to_none=True)
        loss = run()
        loss.backward()
        opt.step()
        return float(loss.detach())

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync()
    warm = time.perf_counter() - t0
    print(f"    [{variant}] {args.warmup} warm-up steps in {warm:.1f} s", file=sys.stderr, flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        value = step()
        sync()
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    out = {"variant": variant, "tokens_per_s": seqs * seq_len / med, "step_s": med, "warmup_s": warm,
           "value": value, "params": sum(p.numel() for p in model.parameters()), **info}
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["device"] = torch.cuda.get_device_name()
    if args.profile and variant in ("ours", "hf"):
        out["profile"] = _profile(step, device)
    return out


def _child(variant: str, setup: str, shape: str, args) -> tuple[dict | None, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--variant", variant, "--setup", setup, "--shape", shape,
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += (["--smoke"] if args.smoke else []) + (["--profile"] if args.profile else [])
    try:
        # stderr is not captured: the child's progress and errors go straight to this run's log
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {args.timeout} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = proc.stdout.strip().splitlines()[-1:] or ["see its stderr above"]
        return None, f"exit {proc.returncode}: {tail[0][:200]}"
    return json.loads(lines[-1][len("RESULT "):]), ""


def run_setup(setup: str, shape: str, args) -> dict:
    seqs, seq_len = parse_shape(shape)
    model_shape = shape_of(setup, args.smoke)
    forward_only = setup in FORWARD_ONLY
    flops = model_flops_per_token(model_shape, seq_len, forward_only)
    note = f" ({model_shape['note']})" if model_shape.get("note") else ""
    print(f"== {setup}{note}, {shape} tokens/step, {'forward only' if forward_only else 'training step'}",
          flush=True)
    results = {}
    for variant in args.variants.split(","):
        if args.smoke and variant == "ours-compiled" and setup != args.setup.split(",")[0]:
            print(f"  {variant:14s} not run in --smoke past the first set-up (CPU compile takes minutes)")
            continue
        if args.smoke and variant == "hf-liger":
            print(f"  {variant:14s} not run in --smoke: Liger-Kernel's Triton kernels need CUDA")
            continue
        if variant == "megatron" and (forward_only or model_shape["family"] == "qwen3_moe"):
            print(f"  {variant:14s} not run: {'no log-prob step of its own' if forward_only else 'MoE needs TE'}")
            continue
        res, error = _child(variant, setup, shape, args)
        if res is None:
            print(f"  {variant:14s} FAILED ({error})", flush=True)
            continue
        results[variant] = res
        device = res.get("device", "cpu (smoke)")
        peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
        res["mfu"] = 100 * res["tokens_per_s"] * flops / (peak * 1e12) if peak else None
        mfu = f"{res['mfu']:5.1f}%" if res["mfu"] is not None else "  n/a"
        mem = f"{res['peak_gib']:6.1f} GiB" if "peak_gib" in res else "     n/a"
        extra = ", ".join(f"{k}={res[k]}" for k in ("attention_kernel", "experts_implementation", "fusions", "liger")
                          if k in res)
        print(f"  {variant:14s} {res['tokens_per_s']:10.0f} tokens/s  MFU {mfu}  peak {mem}  "
              f"value {res['value']:.4f}  ({device}; {extra})", flush=True)
        for line in res.get("profile", []):
            print(f"      {line}")
    for base in ("hf", "hf-liger", "megatron"):
        if base in results:
            for variant, res in results.items():
                if variant != base:
                    ratio = res["tokens_per_s"] / results[base]["tokens_per_s"]
                    mem = (f", peak memory {res['peak_gib'] / results[base]['peak_gib']:.2f}x"
                           if "peak_gib" in res and "peak_gib" in results[base] else "")
                    print(f"  {variant} / {base}: {ratio:.2f}x tokens/s{mem}")
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.variant:
        seqs, seq_len = parse_shape(args.shape)
        print("RESULT " + json.dumps(run_variant(args.variant, args.setup, seqs, seq_len, args)), flush=True)
        return 0
    unknown = [s for s in args.setup.split(",") if s not in SETUPS]
    if unknown:
        raise SystemExit(f"unknown set-up(s) {unknown}; choose from {', '.join(SETUPS)}")
    failed = 0
    for setup in args.setup.split(","):
        for shape in args.shape.split(","):
            results = run_setup(setup, shape, args)
            failed += sum(1 for v in args.variants.split(",") if v not in results and not (
                v == "megatron" and (setup in FORWARD_ONLY or SETUPS[setup]["family"] == "qwen3_moe"))
                and not (args.smoke and v in ("ours-compiled", "hf-liger")))
    return 1 if failed and args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
