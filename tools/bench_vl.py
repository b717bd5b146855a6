r"""Qwen2-VL training-step benchmark: ours (TP=1) against transformers, and the vision tower split over 2 ranks.

Two measurements in one run, fp32 on CPU, same config, weights and batch on both sides:

  1. Forward + backward samples/s of one training step (zero grads, forward with labels and
     images, ``loss.backward()``; ours also ``finalize_grads()``) of
       * ours: ``models.qwen2_vl.build_parallel_model`` at TP=1 (one process, no torch.distributed),
         called as ``model(**batch, return_logits=False)``;
       * hf:   transformers' ``Qwen2VLForConditionalGeneration`` (``--hf-attn``, default sdpa),
     the same ``--threads`` count each (one comparison per count given). transformers' model is
     built from the config with its own random init and saved with ``save_pretrained``; ours is
     loaded from that directory (the same weights).
     Loss and gradients are compared once first. Rounds run one step of each model, the order
     alternating between rounds, after ``--warmup`` untimed steps each; reported: each side's
     median step time and the median of the per-round ratios t_hf / t_ours (> 1: ours is faster).
     ``--profile`` adds a torch.profiler table of one step of each (top ops by self CPU time).
  2. Per-rank vision-tower time: forward + backward of the tower alone (``model.encode_vision``:
     patch embedding, blocks, merger, then a fixed linear function of the features backwards) on
     all the batch's images, in two processes (gloo, one thread each), each rank timing itself:
       * TP=1: every rank encodes all images alone (what each rank of a group does when the tower
         is not split; both ranks run at once, so they share the machine the way TP=2 does);
       * TP=2: the tower tensor-parallel over the 2 ranks (Megatron SP changes nothing in the tower:
         it is the same split);
       * cp=2: the model built with ``ParallelConfig(cp=2)``, timing what its forward encodes images
         with (``encode_vision_shared``: whole images dealt to the cp ranks by patch count, each rank
         encodes its own, features all-gathered), if its forward accepts images at cp=2 (otherwise
         "cp=2: not supported yet" is printed).
     Rounds interleave the layouts (order alternating, a barrier before each step); reported per
     rank: median ms per tower step and the ratio to that rank's TP=1 time (< 1: the split helps).
     TP=2 and cp=2 features are checked against TP=1's first.

Run: ``python tools/bench_vl.py`` (about 2 minutes at the defaults on 2 cores; ``--skip-tower`` or
``--skip-model`` for one part). On a small VM whose vCPUs are shared, libgomp's spin-waiting makes
2-thread runs slow and noisy; ``OMP_WAIT_POLICY=PASSIVE`` (or ``--threads 1``) steadies them.
The last line is machine-readable. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH")]))  # for spawned ranks

import torch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=int, default=512, help="text hidden_size (also the vision merger's output)")
    p.add_argument("--layers", type=int, default=4, help="text num_hidden_layers")
    p.add_argument("--heads", type=int, default=8, help="text num_attention_heads")
    p.add_argument("--kv-heads", type=int, default=2, help="text num_key_value_heads")
    p.add_argument("--ffn", type=int, default=1408, help="text intermediate_size")
    p.add_argument("--vocab", type=int, default=32000, help="vocab_size (the last 4 ids are the vision tokens)")
    p.add_argument("--vision-embed", type=int, default=384, help="vision embed_dim")
    p.add_argument("--vision-depth", type=int, default=4, help="vision depth (blocks)")
    p.add_argument("--vision-heads", type=int, default=6, help="vision num_heads (embed/heads divisible by 4)")
    p.add_argument("--mlp-ratio", type=int, default=4, help="vision mlp_ratio")
    p.add_argument("--patch", type=int, default=14, help="vision patch_size (pixels)")
    p.add_argument("--grid", type=int, nargs=2, default=(16, 16), metavar=("H", "W"),
                   help="each image's grid in patches (h w; even, spatial_merge_size is 2)")
    p.add_argument("--batch", type=int, default=4, help="samples per step, each with one image")
    p.add_argument("--text", type=int, default=128, help="text tokens per sample (half before, half after the image)")
    p.add_argument("--steps", type=int, default=5, help="timed rounds (one step of each model/layout per round)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per model/layout before timing (>= 1)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                   help="part 1: torch.set_num_threads of both models; one comparison per value given")
    p.add_argument("--hf-attn", default="sdpa", choices=("sdpa", "eager"),
                   help="transformers' attn_implementation (text and vision)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, token ids and pixels")
    p.add_argument("--profile", action="store_true",
                   help="part 1: print a torch.profiler table of one step of each model")
    p.add_argument("--profile-rows", type=int, default=25, help="rows of each --profile table")
    p.add_argument("--skip-model", action="store_true", help="skip part 1 (ours against transformers)")
    p.add_argument("--skip-tower", action="store_true", help="skip part 2 (per-rank vision-tower time)")
    args = p.parse_args(argv)
    if args.grid[0] % 2 or args.grid[1] % 2:
        p.error("--grid H W must be even (spatial_merge_size 2)")
    if args.warmup < 1:
        p.error("--warmup must be >= 1")
    return args


# ----------------------------------------------------------------------------------------------- inputs


def config_kwargs(args) -> dict:
    """``Qwen2VLConfig`` keyword arguments (picklable, for the spawned ranks)."""
    head_dim = args.hidden // args.heads
    half = head_dim // 2  # M-RoPE sections (t, h, w) sum to head_dim / 2, in Qwen2-VL's 2:3:3 proportion
    t_sec = half // 4
    h_sec = (half - t_sec) // 2
    v = args.vocab
    return {
        "text_config": {
            "vocab_size": v, "hidden_size": args.hidden, "intermediate_size": args.ffn,
            "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "mrope_section": [t_sec, h_sec, half - t_sec - h_sec]},
        },
        "vision_config": {
            "depth": args.vision_depth, "embed_dim": args.vision_embed, "hidden_size": args.hidden,
            "num_heads": args.vision_heads, "mlp_ratio": args.mlp_ratio, "patch_size": args.patch,
            "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
        },
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "image_token_id": v - 4, "video_token_id": v - 3, "vision_start_token_id": v - 2, "vision_end_token_id": v - 1,
    }


def hf_config(kwargs: dict, attn: str | None = None):
    import copy

    from transformers import Qwen2VLConfig

    cfg = Qwen2VLConfig(**copy.deepcopy(kwargs))
    if attn is not None:
        cfg._attn_implementation = attn
    return cfg


def make_batch(args, kw: dict) -> dict:
    """``--batch`` rows of equal length: text, <vision_start>, h*w/4 image tokens, <vision_end>, text.

    Pixels are one row per patch (``[batch*h*w, 3*2*patch*patch]``) as the image processor emits
    them; labels are the ids with -100 on the image tokens; no padding."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    h, w = args.grid
    before = args.text // 2
    rows = []
    for _ in range(args.batch):
        text = torch.randint(0, kw["image_token_id"], (args.text,), generator=gen)
        rows.append(torch.cat([text[:before], torch.tensor([kw["vision_start_token_id"]]),
                               torch.full((h * w // 4,), kw["image_token_id"]),
                               torch.tensor([kw["vision_end_token_id"]]), text[before:]]))
    ids = torch.stack(rows)
    types = (ids == kw["image_token_id"]).long()
    patch_dim = 3 * 2 * args.patch ** 2
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.masked_fill(types == 1, -100),
            "pixel_values": torch.randn(args.batch * h * w, patch_dim, generator=gen),
            "image_grid_thw": torch.tensor([[1, h, w]] * args.batch), "mm_token_type_ids": types}


# ----------------------------------------------------------------------- part 1: ours against transformers


def build_pair(args, kw: dict, workdir: str):
    from transformers import Qwen2VLForConditionalGeneration

    from models.qwen2_vl import build_parallel_model

    torch.manual_seed(args.seed)
    hf = Qwen2VLForConditionalGeneration(hf_config(kw, args.hf_attn)).float()
    hf.save_pretrained(workdir)
    ours = build_parallel_model(workdir, seed=args.seed)
    return ours.float().train(), hf.train()


def make_step(name: str, model, batch: dict):
    if name == "ours":
        def step():
            model.zero_grad(set_to_none=True)
            loss = model(**batch, return_logits=False).loss
            loss.backward()
            model.finalize_grads()
            return loss
    else:
        def step():
            model.zero_grad(set_to_none=True)
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            return loss
    return step


def grad_diff(ours, hf) -> float:
    """Max relative gradient difference over every tensor, under the on-disk HF names."""
    from models.qwen2_vl.architecture import ARCHITECTURE

    ref = {ARCHITECTURE.canonical_name(n): p.grad for n, p in hf.named_parameters() if p.grad is not None}
    mine = dict(ours.iter_hf_weights({n: p.grad for n, p in ours.named_parameters()}))
    if set(mine) != set(ref):
        raise RuntimeError(f"gradient names differ: {sorted(set(mine) ^ set(ref))[:6]}")
    return max(float((mine[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)) for n in ref)


def profile(name: str, step, rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(f"\nprofile of one step, {name} (top {rows} by self CPU time):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))


def bench_model(args, kw: dict, batch: dict) -> dict[int, float]:
    torch.set_num_threads(args.threads[0])
    with tempfile.TemporaryDirectory(prefix="bench_vl_") as workdir:
        t0 = time.perf_counter()
        ours, hf = build_pair(args, kw, workdir)
        t_build = time.perf_counter() - t0
    n_params = sum(p.numel() for p in ours.parameters())
    n_vis = sum(p.numel() for p in ours.visual.parameters())
    print(f"part 1: TP=1, fp32, params {n_params / 1e6:.1f}M "
          f"(vision {n_vis / 1e6:.1f}M), transformers attn_implementation={args.hf_attn} (build {t_build:.1f}s)")
    steps = {"ours": make_step("ours", ours, batch), "hf": make_step("hf", hf, batch)}
    losses = {name: step().item() for name, step in steps.items()}  # also the first warm-up step
    print(f"check: loss ours {losses['ours']:.6f} hf {losses['hf']:.6f} |Δloss| "
          f"{abs(losses['ours'] - losses['hf']):.2e}; max relative |Δgrad| {grad_diff(ours, hf):.2e}")
    if args.profile:
        for name, step in steps.items():
            profile(name, step, args.profile_rows)
    return {threads: compare(args, steps, threads) for threads in args.threads}


def compare(args, steps: dict, threads: int) -> float:
    """Interleaved timed rounds at ``threads`` threads (after ``--warmup`` steps each); hf/ours ratio."""
    torch.set_num_threads(threads)
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    names = list(steps)
    times = {n: [] for n in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(args.steps):
            for name in (names if r % 2 == 0 else names[::-1]):
                t0 = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    med = {n: statistics.median(t) for n, t in times.items()}
    ratio = statistics.median(h / o for h, o in zip(times["hf"], times["ours"]))
    print(f"  {threads} thread(s):")
    for n in names:
        print(f"    {n:<5} median {med[n]:.3f} s/step -> {args.batch / med[n]:.2f} samples/s "
              f"({' '.join(f'{t:.2f}' for t in times[n])})")
    print(f"    ours/transformers samples/s: {ratio:.2f}x (median of per-round ratios; medians: "
          f"{med['hf'] / med['ours']:.2f}x)")
    return ratio


# ------------------------------------------------------------------ part 2: per-rank vision-tower time


def encode(model):
    """What the model's forward encodes images with: shared by the cp x ulysses ranks, else ``encode_vision``."""
    shared = getattr(model, "encode_vision_shared", None)
    return shared if shared is not None and model.groups.sequence_split else model.encode_vision


def tower_step(model, batch: dict, weight: torch.Tensor) -> float:
    """One forward + backward of the tower on every image of the batch; seconds."""
    start = time.perf_counter()
    feats = encode(model)(batch["input_ids"], batch["pixel_values"], batch["image_grid_thw"], None, None)
    (feats.features * weight).sum().backward()
    return time.perf_counter() - start


def tower_worker(args, kw: dict, batch: dict) -> dict:
    import torch.distributed as dist

    from models.qwen2_vl import build_parallel_model
    from parallel import ParallelConfig
    from parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    cfg = hf_config(kw)
    models = {"TP=1": build_parallel_model(cfg, groups=ParallelGroups.single(), seed=args.seed),
              "TP=2": build_parallel_model(cfg, ParallelConfig(tp=2), seed=args.seed)}
    out = {"cp": None}
    try:  # does the model take images at cp=2? (a whole forward decides, as a training job would)
        cp_model = build_parallel_model(cfg, ParallelConfig(cp=2), seed=args.seed)
        with torch.no_grad():
            cp_model(**batch, return_logits=False)
        models["cp=2"] = cp_model
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        out["cp"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    n_feat = batch["pixel_values"].shape[0] // 4
    weight = torch.randn(n_feat, args.hidden, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = models["TP=1"].encode_vision(batch["input_ids"], batch["pixel_values"], batch["image_grid_thw"],
                                           None, None).features
        out["diff"] = {name: float((encode(m)(batch["input_ids"], batch["pixel_values"],
                                                    batch["image_grid_thw"], None, None).features - ref).abs().max())
                       for name, m in models.items() if name != "TP=1"}
    names = list(models)
    for name in names:
        for _ in range(args.warmup):
            dist.barrier()
            tower_step(models[name], batch, weight)
    times = {n: [] for n in names}
    for r in range(args.steps):
        for name in (names if r % 2 == 0 else names[::-1]):
            for p in models[name].parameters():
                p.grad = None
            dist.barrier()
            times[name].append(tower_step(models[name], batch, weight))
    out["times"] = times
    return out


def bench_tower(args, kw: dict, batch: dict) -> dict:
    from parallel.launch import run_distributed

    h, w = args.grid
    print(f"\npart 2: vision tower forward+backward on {args.batch} images of {h}x{w} patches "
          f"({args.batch * h * w} patches), 2 processes (gloo) x 1 thread")
    per_rank = run_distributed(2, tower_worker, args, kw, batch)
    if per_rank[0]["cp"] is not None:
        print(f"  cp=2: not supported yet ({per_rank[0]['cp']})")
    for name in per_rank[0]["diff"]:
        print(f"  check: {name} features vs TP=1: max |Δ| {max(r['diff'][name] for r in per_rank):.2e}")
    ratios = {}
    for rank, res in enumerate(per_rank):
        times = res["times"]
        base = statistics.median(times["TP=1"])
        parts = [f"TP=1 {base * 1e3:.0f} ms"]
        for name, t in times.items():
            if name == "TP=1":
                continue
            ratio = statistics.median(x / b for x, b in zip(t, times["TP=1"]))
            ratios.setdefault(name, []).append(ratio)
            parts.append(f"{name} {statistics.median(t) * 1e3:.0f} ms ({ratio:.2f}x of TP=1)")
        print(f"  rank {rank}: " + ", ".join(parts))
    # the slower rank decides a step: per round, the larger of the ranks' times
    for name in ratios:
        slow = [max(r["times"][name][i] for r in per_rank) / max(r["times"]["TP=1"][i] for r in per_rank)
                for i in range(args.steps)]
        ratios[name] = statistics.median(slow)
        print(f"  {name}: slower rank's time / TP=1's = {ratios[name]:.2f}x (median of per-round ratios)")
    return ratios


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    kw = config_kwargs(args)
    batch = make_batch(args, kw)
    h, w = args.grid
    seq = batch["input_ids"].shape[1]
    print(f"config: text hidden {args.hidden}, {args.layers} layers, heads {args.heads}/{args.kv_heads}, ffn "
          f"{args.ffn}, vocab {args.vocab}; vision embed {args.vision_embed}, depth {args.vision_depth}, heads "
          f"{args.vision_heads}, mlp_ratio {args.mlp_ratio}, patch {args.patch}; batch {args.batch} x {seq} tokens "
          f"({h * w // 4} image tokens from a {h}x{w}-patch image each); torch {torch.__version__}")
    results = []
    if not args.skip_model:
        for threads, ratio in bench_model(args, kw, batch).items():
            results.append(f"ratio_vs_hf_{threads}t={ratio:.2f}")
    if not args.skip_tower:
        for name, ratio in bench_tower(args, kw, batch).items():
            results.append(f"tower_{name.replace('=', '').lower()}_vs_tp1={ratio:.2f}")
    print(f"\nwall time {time.perf_counter() - t_start:.0f}s")
    print(" ".join(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
