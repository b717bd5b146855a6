"""MoE layer forward+backward throughput: our Qwen2-MoE block against transformers', and EP=2 against EP=1.

Three measurements in one run, on the same machine, same config and weights:
  1. our block at EP=1 against transformers' ``Qwen2MoeSparseMoeBlock`` (its default per-expert loop,
     "eager"; also "batched_mm"/"grouped_mm" when they run here), one process, ``--threads`` threads,
     ``--tokens`` tokens; rounds interleave the implementations and the ratio is the median of
     per-round ratios (the VM's speed drifts, block timing misleads). Outputs and gradients are
     checked equal first. Ours runs with each expert kernel of ``--experts-kernel`` (``loop``, the
     per-expert reference, and/or ``grouped``, torch._grouped_mm; parallel/experts.py), and the
     grouped/loop ratio is printed too. ``--device cuda --dtype bf16`` runs this part on a GPU.
  2. EP=2: two processes (gloo, ``--threads // 2`` threads each), each routing its own ``--tokens``
     tokens over the experts split between them, with the all-to-all and the all-gather dispatcher;
     against EP=1 running the same 2 x tokens in one process with ``--threads`` threads.
Tokens/s = tokens through the layer (forward + backward) per second of wall time.

Run: ``python tools/bench_moe.py`` (about a minute at the defaults). Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def hf_config(args):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.moe_inter,
                          shared_expert_intermediate_size=args.shared, num_experts=args.experts,
                          num_experts_per_tok=args.top_k, norm_topk_prob=False, intermediate_size=args.shared,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=32)


def reference_block(args, implementation: str = "eager"):
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = hf_config(args)
    cfg._experts_implementation = implementation
    torch.manual_seed(0)
    block = Qwen2MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.05)
    return block.to(getattr(args, "device", "cpu"), DTYPES[getattr(args, "dtype", "fp32")])


def our_block(args, reference, groups=None, kernel=None):
    """Our ParallelMoE holding ``groups``' share of the reference block's experts (same weights),
    running expert kernel ``kernel`` (None: the default for the device and dtype)."""
    from models.common.blocks.moe import ParallelMoE
    from models.qwen2_moe.config import model_config
    from parallel.groups import ParallelGroups

    groups = groups or ParallelGroups.single()
    cfg = model_config(hf_config(args))
    ref = reference
    block = ParallelMoE(cfg, groups, ref.gate.weight.dtype, ref.gate.weight.device)
    block.experts_kernel = kernel
    local = args.experts // groups.ep_size
    lo = groups.ep_rank * local
    with torch.no_grad():
        block.gate.weight.copy_(ref.gate.weight)
        block.experts.w13_weight.copy_(ref.experts.gate_up_proj[lo:lo + local])
        block.experts.w2_weight.copy_(ref.experts.down_proj[lo:lo + local])
        block.shared_expert.gate_up_proj.weight.copy_(torch.cat([ref.shared_expert.gate_proj.weight,
                                                                 ref.shared_expert.up_proj.weight]))
        block.shared_expert.down_proj.weight.copy_(ref.shared_expert.down_proj.weight)
        block.shared_expert_gate.weight.copy_(ref.shared_expert_gate.weight)
    return block


def tokens(args, count: int, seed: int) -> torch.Tensor:
    return torch.randn(count, args.hidden, generator=torch.Generator().manual_seed(seed))


def _sync(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def step(block, x: torch.Tensor, ours: bool) -> float:
    """One forward+backward; seconds."""
    p = next(block.parameters())
    x = x.to(p.device, p.dtype).requires_grad_(True)
    _sync(x)
    start = time.perf_counter()
    out = block(x[:, None, :]) if ours else block(x[None])  # ours: [s, b, h]; transformers: [b, s, h]
    out.float().square().mean().backward()
    _sync(x)
    return time.perf_counter() - start


def check_equal(args, reference, ours) -> tuple[float, float]:
    p = next(reference.parameters())
    x = tokens(args, 256, 1).to(p.device, p.dtype)
    a = x.clone().requires_grad_(True)
    b = x.clone().requires_grad_(True)
    out_ref = reference(a[None])[0]
    out = ours(b[:, None, :])[:, 0]
    out_ref.float().square().mean().backward()
    out.float().square().mean().backward()
    grad_diff = max((reference.experts.gate_up_proj.grad - ours.experts.w13_weight.grad).abs().max().item(),
                    (a.grad - b.grad).abs().max().item())
    reference.zero_grad()
    ours.zero_grad()
    return (out - out_ref).abs().max().item(), grad_diff


def bench_single(args) -> dict:
    torch.set_num_threads(args.threads)
    impls = {"eager": reference_block(args, "eager")}
    for name in [i for i in args.hf_impls.split(",") if i and i != "eager"]:
        try:
            block = reference_block(args, name)
            step(block, tokens(args, 64, 0), ours=False)
            impls[name] = block
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            print(f"transformers experts_implementation={name!r} does not run here: {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:100]}")
    kernels = ["loop", "grouped"] if args.experts_kernel == "both" else [args.experts_kernel]
    ours = {f"ours:{k}": our_block(args, impls["eager"], kernel=k) for k in kernels}
    for name, block in ours.items():
        out_diff, grad_diff = check_equal(args, impls["eager"], block)
        print(f"check {name}: |Δout| {out_diff:.2e}, |Δgrad| {grad_diff:.2e} (vs transformers eager, {args.dtype})")
    x = tokens(args, args.tokens, 2)
    runs = [(name, b, True) for name, b in ours.items()] + [(name, b, False) for name, b in impls.items()]
    for _, block, is_ours in runs:
        step(block, x, is_ours)  # warm-up
    times = {name: [] for name, _, _ in runs}
    for _ in range(args.rounds):
        for name, block, is_ours in runs:
            times[name].append(step(block, x, is_ours))
    result = {}
    for mine in ours:
        for name in impls:
            ratios = [r / o for r, o in zip(times[name], times[mine])]
            result[(mine, name)] = statistics.median(ratios)
            print(f"EP=1 {args.tokens} tokens: {mine} {statistics.median(times[mine]) * 1e3:.1f} ms, transformers "
                  f"{name} {statistics.median(times[name]) * 1e3:.1f} ms -> ours is {result[(mine, name)]:.2f}x "
                  f"(median of per-round ratios)")
    if len(ours) == 2:
        ratio = statistics.median([a / b for a, b in zip(times["ours:loop"], times["ours:grouped"])])
        print(f"EP=1 {args.tokens} tokens: experts kernel grouped is {ratio:.2f}x the loop "
              f"(median of per-round ratios)")
    return result


def _ep_kernel(args) -> str | None:
    """The expert kernel of the EP part: the one asked for, or the default for the device with ``both``."""
    return None if args.experts_kernel == "both" else args.experts_kernel


def ep_worker(args) -> dict:
    import torch.distributed as dist

    from parallel import ParallelConfig
    from parallel.groups import build_groups

    torch.set_num_threads(max(1, args.threads // 2))
    reference = reference_block(args)
    out = {}
    x = tokens(args, args.tokens, 10 + dist.get_rank())
    blocks = {}
    for dispatcher in ("alltoall", "allgather"):
        groups = build_groups(ParallelConfig(ep=2, moe_dispatcher=dispatcher))
        blocks[dispatcher] = our_block(args, reference, groups, kernel=_ep_kernel(args))
        step(blocks[dispatcher], x, True)
    for dispatcher in blocks:
        out[dispatcher] = []
    for _ in range(args.rounds):
        for dispatcher, block in blocks.items():
            dist.barrier()
            out[dispatcher].append(step(block, x, True))
    return out


def bench_ep(args) -> None:
    from parallel.launch import run_distributed

    per_rank = run_distributed(2, ep_worker, args)
    torch.set_num_threads(args.threads)
    reference = reference_block(args)
    ours = our_block(args, reference, kernel=_ep_kernel(args))
    x = tokens(args, 2 * args.tokens, 3)
    step(ours, x, True)
    single = [step(ours, x, True) for _ in range(args.rounds)]
    t1 = statistics.median(single)
    print(f"EP=1, {2 * args.tokens} tokens, {args.threads} threads: {t1 * 1e3:.1f} ms "
          f"-> {2 * args.tokens / t1:,.0f} tokens/s")
    for dispatcher in ("alltoall", "allgather"):
        rounds = [max(r[dispatcher][i] for r in per_rank) for i in range(args.rounds)]  # the slower rank
        t2 = statistics.median(rounds)
        print(f"EP=2 {dispatcher:9s}, 2 x {args.tokens} tokens, 2 processes x {max(1, args.threads // 2)} "
              f"threads: {t2 * 1e3:.1f} ms -> {2 * args.tokens / t2:,.0f} tokens/s ({t1 / t2:.2f}x EP=1)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512, help="hidden size")
    p.add_argument("--moe-inter", type=int, default=256, help="moe_intermediate_size (per expert)")
    p.add_argument("--shared", type=int, default=1024, help="shared_expert_intermediate_size")
    p.add_argument("--experts", type=int, default=32, help="num_experts")
    p.add_argument("--top-k", type=int, default=4, help="num_experts_per_tok")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per step (per rank at EP=2)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per implementation")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the single process (EP=2: half each)")
    p.add_argument("--skip-ep", action="store_true", help="only the EP=1 comparison with transformers")
    p.add_argument("--experts-kernel", choices=("loop", "grouped", "both"), default="both",
                   help="our expert kernel(s) in the EP=1 comparison (parallel/experts.py)")
    p.add_argument("--hf-impls", default="batched_mm,grouped_mm",
                   help="transformers expert implementations timed beside its eager loop (comma-separated; "
                        "batched_mm needs tokens*top_k*3*H*I*4 bytes)")
    p.add_argument("--device", default="cpu", help="device of the EP=1 comparison (cuda: --skip-ep implied)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the EP=1 comparison")
    args = p.parse_args()
    if args.device != "cpu":
        args.skip_ep = True  # the EP=2 part runs gloo processes on the CPU
    print(f"config: hidden {args.hidden}, {args.experts} experts x {args.moe_inter}, top-{args.top_k}, shared "
          f"{args.shared}, {args.tokens} tokens, {args.dtype} on {args.device}, torch {torch.__version__}")
    bench_single(args)
    if not args.skip_ep:
        bench_ep(args)


if __name__ == "__main__":
    main()
