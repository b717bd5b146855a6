r"""Qwen3-VL vision-tower benchmark: ours (TP=1) against transformers' ``Qwen3VLVisionModel`` on CPU.

One training step of the tower alone, forward + backward, on the same weights and the same batch:
two images of different sizes and a short video in one tower pass (what a training step's
``encode_vision`` does), the loss a fixed linear function of every output (the merged features and
the DeepStack features side by side), gradients cleared before each step.

  * ours: ``models.qwen3_vl.build_parallel_model(dir, dtype=...)`` at TP=1 (one process, no
    torch.distributed), its ``visual`` tower; the weights read from the directory transformers wrote
    (the project's own loading path);
  * hf:   ``Qwen3VLForConditionalGeneration``'s ``model.visual`` (``--hf-attn``, default sdpa), built from
    the config with transformers' own random init, saved with ``save_pretrained``, cast to the dtype.

Per dtype (``--dtypes``): the outputs, the pixel gradient and every parameter gradient are compared
first and the benchmark stops (exit 1, no figures) when they disagree (fp32: ours against
transformers', relative 1e-4; bf16: each side against transformers' fp32 tower, ours within twice
transformers' own error); then ``--warmup`` untimed steps
each and ``--steps`` rounds of one step of each, the order alternating between rounds (garbage
collection off while timing). Reported: median and minimum seconds per step of each side (wall clock,
and the process's CPU time, which other processes on a shared machine disturb less), the median of
the per-round ratios t_hf / t_ours (> 1: ours is faster), the ratio of the minima, and
the step's RSS growth of each side (peak resident memory sampled every ms during one untimed step,
minus the resident memory before it, after ``malloc_trim``), and the load average.
``--profile`` prints a torch.profiler table of one step of each side (top ops by self CPU time).

Run: ``python tools/bench_vl_tower.py`` (a few minutes on 2 shared cores at the defaults). The last
line is machine-readable. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--depth", type=int, default=8, help="vision depth (blocks)")
    p.add_argument("--hidden", type=int, default=512, help="vision hidden_size")
    p.add_argument("--heads", type=int, default=8, help="vision num_heads")
    p.add_argument("--ffn", type=int, default=2048, help="vision intermediate_size")
    p.add_argument("--out-hidden", type=int, default=512, help="out_hidden_size (= the text hidden_size)")
    p.add_argument("--patch", type=int, default=16, help="patch_size (pixels)")
    p.add_argument("--positions", type=int, default=2304, help="num_position_embeddings (a square: 48x48)")
    p.add_argument("--deepstack", type=int, nargs="*", default=[2, 4, 6], help="deepstack_visual_indexes")
    p.add_argument("--act", default="gelu_pytorch_tanh", help="vision hidden_act")
    p.add_argument("--images", default="1x16x24,1x12x12",
                   help="image grids t x h x w in patches, comma-separated (h, w even)")
    p.add_argument("--videos", default="2x12x16", help="video grids t x h x w in patches (t frame pairs)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads of both sides")
    p.add_argument("--steps", type=int, default=5, help="timed rounds (one step of each side per round)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per side before timing (>= 1)")
    p.add_argument("--hf-attn", default="sdpa", choices=("sdpa", "eager"), help="transformers' attn_implementation")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the pixels")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step of each side")
    p.add_argument("--profile-rows", type=int, default=25, help="rows of each --profile table")
    args = p.parse_args(argv)
    args.image_grids = _grids(p, args.images)
    args.video_grids = _grids(p, args.videos)
    if args.warmup < 1:
        p.error("--warmup must be >= 1")
    if len(args.deepstack) > 3:
        p.error("--deepstack: at most 3 indexes (the text model built beside the tower has 3 layers)")
    return args


def _grids(p, text: str) -> list[tuple[int, int, int]]:
    grids = []
    for item in filter(None, text.split(",")):
        try:
            t, h, w = (int(x) for x in item.split("x"))
        except ValueError:
            p.error(f"grid {item!r}: expected t x h x w, e.g. 1x16x16")
        if h % 2 or w % 2:
            p.error(f"grid {item!r}: h and w must be even (spatial_merge_size 2)")
        grids.append((t, h, w))
    return grids


def config_kwargs(args) -> dict:
    """``Qwen3VLConfig`` keyword arguments: the tower under test and a 3-layer text model beside it (the
    checkpoint's text half, which the benchmark never runs)."""
    v = 1024
    return {
        "text_config": {
            "vocab_size": v, "hidden_size": args.out_hidden, "intermediate_size": args.out_hidden,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "pad_token_id": 0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [12, 10, 10],
                                "mrope_interleaved": True},
        },
        "vision_config": {
            "depth": args.depth, "hidden_size": args.hidden, "intermediate_size": args.ffn, "num_heads": args.heads,
            "out_hidden_size": args.out_hidden, "patch_size": args.patch, "temporal_patch_size": 2,
            "spatial_merge_size": 2, "in_channels": 3, "hidden_act": args.act,
            "num_position_embeddings": args.positions, "deepstack_visual_indexes": list(args.deepstack),
        },
        "tie_word_embeddings": False, "image_token_id": v - 4, "video_token_id": v - 3,
        "vision_start_token_id": v - 2, "vision_end_token_id": v - 1,
    }


def make_inputs(args) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixels one row per patch (``[sum t*h*w, 3*2*patch^2]``, as the processor emits them) and the grids,
    images then videos (the order a training step passes them to the tower in)."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    grid = torch.tensor(args.image_grids + args.video_grids, dtype=torch.long)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * args.patch ** 2, generator=gen)
    return pixels, grid


def build_pair(args, workdir: str, dtype: torch.dtype, ours: bool = True):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from models.qwen3_vl import build_parallel_model

    if not any(Path(workdir).glob("*.safetensors")):
        torch.manual_seed(args.seed)
        cfg = Qwen3VLConfig(**config_kwargs(args))
        Qwen3VLForConditionalGeneration(cfg).save_pretrained(workdir)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(workdir, dtype=dtype, attn_implementation=args.hf_attn)
    mine = build_parallel_model(workdir, dtype=dtype).visual.train() if ours else None
    return mine, hf.model.visual.train()


def hf_features(tower, pixels, grid) -> torch.Tensor:
    out = tower(pixels, grid_thw=grid)
    return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)


def make_step(name: str, tower, pixels: torch.Tensor, grid: torch.Tensor, weight: torch.Tensor):
    run = (lambda x: tower(x, grid)) if name == "ours" else (lambda x: hf_features(tower, x, grid))

    def step(keep: bool = False):
        tower.zero_grad(set_to_none=True)
        x = pixels.detach().requires_grad_(keep)
        out = run(x)
        (out.float() * weight).sum().backward()
        return (out.detach().float(), x.grad.float()) if keep else None
    return step


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def results(step, tower) -> dict:
    """One step's outputs, pixel gradient and parameter gradients (fp32 copies); transformers' parameter
    names are the tower's own names on both sides."""
    out, grad = step(keep=True)
    return {"output": out, "pixel grad": grad,
            "params": {n: p.grad.float() for n, p in tower.named_parameters() if p.grad is not None}}


def errors(res: dict, ref: dict) -> dict[str, float]:
    if res["output"].shape != ref["output"].shape or set(res["params"]) != set(ref["params"]):
        raise SystemExit(f"outputs or gradient names differ: {tuple(res['output'].shape)} vs "
                         f"{tuple(ref['output'].shape)}; {sorted(set(res['params']) ^ set(ref['params']))[:6]}")
    return {"output": _rel(res["output"], ref["output"]), "pixel grad": _rel(res["pixel grad"], ref["pixel grad"]),
            "param grads": max(_rel(res["params"][n], ref["params"][n]) for n in ref["params"])}


def check(name: str, steps: dict, towers: dict, ref: dict) -> str:
    """fp32: ours against transformers' (max relative |Δ| <= 1e-4). bf16: both against transformers' fp32
    ``ref``; ours must be within 2x transformers' own error (+1e-3). Exits without figures otherwise."""
    got = {n: results(steps[n], towers[n]) for n in steps}
    if name == "fp32":
        err = errors(got["ours"], got["hf"])
        text = ", ".join(f"{k} {v:.2e}" for k, v in err.items())
        ok = max(err.values()) <= 1e-4
    else:
        err, base = errors(got["ours"], ref), errors(got["hf"], ref)
        text = "vs fp32: " + ", ".join(f"{k} ours {v:.2e} hf {base[k]:.2e}" for k, v in err.items())
        ok = all(err[k] <= 2 * base[k] + 1e-3 for k in err)
    if not ok:
        raise SystemExit(f"{name}: ours and transformers disagree (max relative |Δ|: {text}): no figures")
    return text


def reference(args, workdir: str, pixels, grid, weight) -> dict:
    """transformers' fp32 tower's results: what both sides' bf16 results are measured against."""
    _, hf = build_pair(args, workdir, torch.float32, ours=False)
    return results(make_step("hf", hf, pixels, grid, weight), hf)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def step_rss(step) -> float:
    """MiB the resident set grows by during one step (sampled every ms), from a trimmed heap."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    base, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    step()
    done.set()
    thread.join()
    return (max(peak[0], _rss()) - base) / 2 ** 20


def profile(name: str, step, rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(f"\nprofile of one step, {name} (top {rows} by self CPU time):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=72))


def bench(args, workdir: str, dname: str, pixels, grid, weight, ref: dict | None) -> dict:
    dtype = DTYPES[dname]
    ours, hf = build_pair(args, workdir, dtype)
    towers = {"ours": ours, "hf": hf}
    x = pixels.to(dtype)
    steps = {n: make_step(n, t, x, grid, weight) for n, t in towers.items()}
    print(f"\n{dname}: check (max relative |Δ|): {check(dname, steps, towers, ref)}")
    rss = {n: step_rss(s) for n, s in steps.items()}
    if args.profile:
        for n, s in steps.items():
            profile(f"{n} {dname}", s, args.profile_rows)
    for _ in range(args.warmup):
        for s in steps.values():
            s()
    names = list(steps)
    times, cpu = {n: [] for n in names}, {n: [] for n in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(args.steps):
            for n in (names if r % 2 == 0 else names[::-1]):
                t0, c0 = time.perf_counter(), time.process_time()
                steps[n]()
                times[n].append(time.perf_counter() - t0)
                cpu[n].append(time.process_time() - c0)
    finally:
        gc.enable()
    ratio = statistics.median(h / o for h, o in zip(times["hf"], times["ours"]))
    ratio_min = min(times["hf"]) / min(times["ours"])
    ratio_cpu = statistics.median(h / o for h, o in zip(cpu["hf"], cpu["ours"]))
    for n in names:
        print(f"  {n:<4} median {statistics.median(times[n]):.3f} s  min {min(times[n]):.3f} s  CPU median "
              f"{statistics.median(cpu[n]):.3f} s  min {min(cpu[n]):.3f} s  step RSS +{rss[n]:.0f} MiB  "
              f"(wall {' '.join(f'{t:.2f}' for t in times[n])})")
    print(f"  transformers/ours time: {ratio:.2f}x (median of per-round ratios), {ratio_min:.2f}x (minima); "
          f"CPU time {ratio_cpu:.2f}x (median of per-round ratios)")
    return {"ratio": ratio, "ratio_min": ratio_min, "ratio_cpu": ratio_cpu}


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    pixels, grid = make_inputs(args)
    n = int(grid.prod(-1).sum())
    print(f"config: vision depth {args.depth}, hidden {args.hidden}, heads {args.heads}, ffn {args.ffn}, act "
          f"{args.act}, patch {args.patch}, temporal 2, merge 2, positions {args.positions}, deepstack "
          f"{args.deepstack}, out_hidden {args.out_hidden}; images {args.images}, videos {args.videos} "
          f"({n} patches -> {n // 4} merged); threads {args.threads}; transformers attn {args.hf_attn}; "
          f"torch {torch.__version__}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    summary = []
    weight = torch.randn(n // 4, (1 + len(args.deepstack)) * args.out_hidden,
                         generator=torch.Generator().manual_seed(7))  # the loss: sum(features * weight)
    with tempfile.TemporaryDirectory(prefix="bench_vl_tower_") as workdir:
        ref = reference(args, workdir, pixels, grid, weight) if set(args.dtypes) - {"fp32"} else None
        for dname in args.dtypes:
            r = bench(args, workdir, dname, pixels, grid, weight, ref)
            summary.append(f"{dname}_ratio={r['ratio']:.2f} {dname}_ratio_min={r['ratio_min']:.2f} "
                           f"{dname}_ratio_cpu={r['ratio_cpu']:.2f}")
    print(f"\nload average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; wall time "
          f"{time.perf_counter() - t_start:.0f}s")
    print(" ".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
