"""Gated DeltaNet layer forward+backward throughput: our ``ParallelGatedDeltaNet`` against transformers'
``Qwen3_5GatedDeltaNet`` (its torch path: ``torch_chunk_gated_delta_rule``, ``F.conv1d``), same weights.

What it measures
    One linear-attention layer of a Qwen3.5 shape scaled for a CPU (default: hidden 1024, 4 key heads
    and 8 value heads of 128, conv kernel 4: Qwen3.5's 16/32 heads of 128 at hidden 4096, divided by 4),
    ``--tokens`` tokens (8192) in two cases:
      * ``one``:    one sequence of all the tokens (both: batch 1);
      * ``packed``: ``--sequences`` equal sequences (4 x 2048); ours packed flat through ``cu_seqlens``,
                    transformers as a padding-free batch ``[4, 2048]`` (it cannot keep packed
                    sequences apart without flash-linear-attention).
    A step is forward + ``out.square().mean().backward()`` into the layer's input. Rounds interleave
    ours and transformers (order swapped every round) after one warm-up step each; the ratio is the
    median of the per-round time ratios (a shared machine's speed drifts), tokens/s from the median
    times. Same thread count for both (``--threads``).

    Before timing, one step of each is checked: output and input gradient of ours against
    transformers' (max |diff| / max |ref|, bounds in CHECK_BOUND), so the timing cannot be of a wrong
    kernel; a failed check ends the run with exit 1 before any figure.

    Memory of one step: ``saved`` = bytes of the distinct tensors autograd keeps for backward
    (exact, from saved_tensors_hooks, parameters excluded); ``peak`` = on CUDA max_memory_allocated
    over the step beyond what was allocated before it; on CPU the process's peak RSS growth over the
    step (VmHWM after /proc/self/clear_refs and malloc_trim; allocator reuse makes it approximate).

    ``--device cuda`` (bf16 by default there): ours runs its CUDA dispatch (flash-linear-attention's
    ``chunk_gated_delta_rule`` where installed, else the torch reference; ``PMZ_GDN_KERNEL`` forces one,
    parallel/gated_delta_rule.py), transformers its torch path (``--hf-kernel auto`` lets transformers
    take fla/causal-conv1d where it finds them).

Run: ``.venv/bin/python tools/bench_gdn.py`` (~2-4 min on 2 quiet cores); ``--dtypes fp32,bf16``;
``--device cuda``. The last line is machine-readable. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CHECK_BOUND = {torch.float32: 1e-4, torch.bfloat16: 5e-2}  # max |ours - transformers| / max |transformers|


def hf_config(args):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(hidden_size=args.hidden, num_hidden_layers=1, layer_types=["linear_attention"],
                             linear_num_key_heads=args.key_heads, linear_num_value_heads=args.value_heads,
                             linear_key_head_dim=args.head_dim, linear_value_head_dim=args.head_dim,
                             linear_conv_kernel_dim=args.conv, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=64, intermediate_size=64, vocab_size=32)


def reference_layer(args, dtype, device):
    """transformers' layer with random weights of realistic scale (projections keep unit variance)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    if args.hf_kernel == "torch":  # the pure-torch functions, whatever kernels transformers found
        for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
            fn = getattr(hf, name)
            setattr(hf, name, getattr(fn, "__wrapped__", fn))
    gen = torch.Generator().manual_seed(0)
    layer = hf.Qwen3_5GatedDeltaNet(hf_config(args), 0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("proj_qkv.weight") or name.endswith("proj_z.weight") or "proj_b" in name \
                    or "proj_a" in name or name == "out_proj.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
            elif name == "conv1d.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif name == "dt_bias":
                p.copy_(torch.empty(p.shape).uniform_(-4, 0, generator=gen))
    return layer.to(device, dtype)


def our_layer(args, ref):
    """Our single-rank block holding ``ref``'s weights (in_proj_qkvz = [qkv | z], in_proj_ba = [b | a])."""
    from models.common.blocks.gated_deltanet import ParallelGatedDeltaNet
    from models.qwen3_5.config import model_config
    from parallel.groups import ParallelGroups

    w = ref.out_proj.weight
    block = ParallelGatedDeltaNet(model_config(hf_config(args)), ParallelGroups.single(), w.dtype, w.device)
    with torch.no_grad():
        block.in_proj_qkvz.weight.copy_(torch.cat([ref.in_proj_qkv.weight, ref.in_proj_z.weight]))
        block.in_proj_ba.weight.copy_(torch.cat([ref.in_proj_b.weight, ref.in_proj_a.weight]))
        for name in ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"):
            block.get_parameter(name).copy_(ref.get_parameter(name))
    return block


class Case:
    """One input shape: ours takes ``x [T, 1, H]`` (+ cu_seqlens when packed), transformers ``[n, T/n, H]``."""

    def __init__(self, name, x, sequences, packed):
        self.name, self.x, self.sequences, self.packed = name, x, sequences, packed
        t = x.shape[0]
        self.cu = torch.arange(0, t + 1, t // sequences, dtype=torch.int32, device=x.device) if packed else None

    def run(self, layer, ours: bool):
        """One step; returns (output as [T, H], input gradient as [T, H])."""
        x = self.x.detach().clone().requires_grad_(True)
        if ours:
            out = layer(x[:, None], cu_seqlens=self.cu, max_seqlen=None)[:, 0]
        else:
            out = layer(x.reshape(self.sequences, -1, x.shape[-1])).reshape(x.shape)
        out.float().square().mean().backward()
        return out.detach(), x.grad


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(case, layer, ours: bool) -> float:
    _sync(case.x.device)
    start = time.perf_counter()
    case.run(layer, ours)
    _sync(case.x.device)
    return time.perf_counter() - start


def saved_bytes(case, layer, ours: bool) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves for backward in one step."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        case.run(layer, ours)
    return sum(seen.values())


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def peak_bytes(case, layer, ours: bool) -> int:
    """Memory one step takes beyond what is held before it (CUDA allocator, or CPU peak RSS)."""
    gc.collect()
    if case.x.is_cuda:
        torch.cuda.synchronize(case.x.device)
        torch.cuda.reset_peak_memory_stats(case.x.device)
        before = torch.cuda.memory_allocated(case.x.device)
        case.run(layer, ours)
        return torch.cuda.max_memory_allocated(case.x.device) - before
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return 0
    before = _rss("VmRSS")
    case.run(layer, ours)
    return _rss("VmHWM") - before


def check(case, ref, ours) -> tuple[float, float]:
    """Relative max differences (output, input gradient) of ours against transformers."""
    out_ref, grad_ref = case.run(ref, False)
    out, grad = case.run(ours, True)
    rel = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
           for a, b in ((out, out_ref), (grad, grad_ref))]
    return rel[0], rel[1]


def bench_case(args, case, ref, ours) -> dict:
    out_rel, grad_rel = check(case, ref, ours)
    bound = CHECK_BOUND[case.x.dtype]
    print(f"check {case.name}: output {out_rel:.2e}, input grad {grad_rel:.2e} (relative to transformers; "
          f"bound {bound:.0e})", flush=True)
    if not (out_rel < bound and grad_rel < bound):
        raise SystemExit(f"bench_gdn: ours disagrees with transformers on {case.name} ({out_rel:.2e}, {grad_rel:.2e} "
                         f"> {bound:.0e}): not timing a wrong kernel")
    impls = [("ours", ours, True), ("transformers", ref, False)]
    for _, layer, is_ours in impls:
        timed(case, layer, is_ours)  # warm-up
    times = {name: [] for name, _, _ in impls}
    for r in range(args.rounds):
        for name, layer, is_ours in (impls if r % 2 == 0 else impls[::-1]):
            times[name].append(timed(case, layer, is_ours))
    ratio = statistics.median(h / o for h, o in zip(times["transformers"], times["ours"]))
    tokens = case.x.shape[0]
    result = {"case": case.name, "ratio": ratio}
    for name, layer, is_ours in impls:
        result[name] = {"tokens_per_s": tokens / statistics.median(times[name]),
                        "saved": saved_bytes(case, layer, is_ours), "peak": peak_bytes(case, layer, is_ours)}
    mib = 2.0 ** 20
    for name, _, _ in impls:
        r = result[name]
        print(f"  {case.name:<22} {name:<12} {r['tokens_per_s']:>10,.0f} tokens/s   saved {r['saved'] / mib:8.1f} MiB"
              f"   peak {r['peak'] / mib:8.1f} MiB", flush=True)
    print(f"  {case.name:<22} ours is {ratio:.2f}x transformers (median of {args.rounds} per-round ratios); "
          f"memory saved {result['ours']['saved'] / max(result['transformers']['saved'], 1):.2f}x", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--key-heads", type=int, default=4)
    parser.add_argument("--value-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--conv", type=int, default=4, help="conv kernel taps")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--sequences", type=int, default=4, help="sequences of the packed case")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtypes", default=None, help="comma-separated fp32,bf16 (default: fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--hf-kernel", default="torch", choices=["torch", "auto"],
                        help="transformers' torch path, or whatever kernels it finds installed")
    parser.add_argument("--cases", default="one,packed")
    args = parser.parse_args()
    if args.tokens % args.sequences:
        parser.error(f"--tokens {args.tokens} is not divisible by --sequences {args.sequences}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtypes = (args.dtypes or ("bf16" if args.device == "cuda" else "fp32")).split(",")
    commit = _commit()
    print(f"bench_gdn: hidden {args.hidden}, heads {args.key_heads}/{args.value_heads} x {args.head_dim}, conv "
          f"{args.conv}, {args.tokens} tokens, {args.threads} threads, device {_device_name(device)}, torch "
          f"{torch.__version__}, commit {commit}", flush=True)
    results = []
    for dt in dtypes:
        dtype = DTYPES[dt]
        ref = reference_layer(args, dtype, device)
        ours = our_layer(args, ref)
        x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        for name in args.cases.split(","):
            packed = name == "packed"
            n = args.sequences if packed else 1
            label = f"{dt} {n}x{args.tokens // n}" + (" packed" if packed else "")
            results.append((dt, name, bench_case(args, Case(label, x, n, packed), ref, ours)))
    print(" ".join(f"{dt}_{name}={r['ratio']:.3f}" for dt, name, r in results))


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return "CPU " + line.split(":", 1)[1].strip()
    return "CPU"


def _commit() -> str:
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "parallel", "models", "tools/bench_gdn.py"],
                               capture_output=True, text=True, cwd=root, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" + uncommitted changes" if dirty else "")


if __name__ == "__main__":
    main()
