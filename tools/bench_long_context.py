"""Long-context benchmark: activation memory per rank and training-step speed per layout.

(a) Activation bytes saved for backward per rank, counted exactly with
    ``torch.autograd.graph.saved_tensors_hooks`` (unique storages, parameters excluded) during one
    training forward, for cp, ulysses and tp+sp at N in {2, 4} ranks and several sequence lengths,
    as a ratio to the single-rank figure at the same length (ideal 1/N; reported also as
    ``ratio * N``, ideal 1.00, target <= 1.15). Machine-independent.
(b) Tokens/s of a training step (forward + backward + finalize_grads) per layout on N ranks
    against the single-rank step on the same sequence in the same run; efficiency =
    speed-up / N (target >= 0.8 at the longest length). Every rank - and the single-rank
    baseline - runs one thread, so N ranks use N cores; layouts with more ranks than the machine
    has cores are not timed.

    .venv/bin/python tools/bench_long_context.py                    # tables on stdout
    .venv/bin/python tools/bench_long_context.py --json out.json --plot docs/figures/long_context_memory.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from parallel import ParallelConfig  # noqa: E402
from parallel.launch import run_distributed  # noqa: E402

LAYOUTS = {"cp": lambda n: dict(cp=n), "ulysses": lambda n: dict(ulysses=n),
           "tp+sp": lambda n: dict(tp=n, sequence_parallel=True),
           "cp-allgather": lambda n: dict(cp=n, cp_comm="allgather")}
DEFAULT_LAYOUTS = ("cp", "ulysses", "tp+sp")


def model_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1 << 17,
                       tie_word_embeddings=False)


def _batch(length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length))


def saved_bytes(model, fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn()`` runs (not parameters)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params:
            seen.setdefault(ptr, storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def memory_body(kwargs: dict, lengths: list[int]) -> list[int]:
    from models.qwen2 import build_parallel_model

    cfg = model_config()
    model = build_parallel_model(cfg, ParallelConfig(**kwargs), seed=1)
    result = []
    for length in lengths:
        ids = _batch(length, cfg.vocab_size)
        result.append(saved_bytes(model, lambda ids=ids: model(ids, labels=ids, return_logits=False).loss))
    return result


def speed_body(kwargs: dict, lengths: list[int], repeats: int) -> list[float]:
    """Median seconds of one training step per length (all ranks time the same steps)."""
    import torch.distributed as dist

    from models.qwen2 import build_parallel_model

    cfg = model_config()
    model = build_parallel_model(cfg, ParallelConfig(**kwargs), seed=1)
    result = []
    for length in lengths:
        ids = _batch(length, cfg.vocab_size)
        times = []
        for step in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            model(ids, labels=ids, return_logits=False).loss.backward()
            model.finalize_grads()
            dist.barrier()
            if step:  # the first step warms up
                times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        result.append(statistics.median(times))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                        help="sequence lengths (tokens) for the activation-memory part (a)")
    parser.add_argument("--speed-lengths", type=int, nargs="+", default=[2048, 8192, 16384],
                        help="sequence lengths (tokens) for the step-speed part (b)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                        help="rank counts N per layout (speed: only N <= cores)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed training steps per point in part (b) (median; one more warms up)")
    parser.add_argument("--only", choices=["memory", "speed"], help="run only part (a) memory or (b) speed")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(DEFAULT_LAYOUTS),
                        help="layouts to measure")
    parser.add_argument("--json", metavar="PATH", help="also write all figures to this JSON file")
    parser.add_argument("--plot", metavar="PATH", help="also write the memory plot (PNG, needs .[bench]) here")
    args = parser.parse_args()
    cores = os.cpu_count() or 1

    print(f"model: Qwen2 hidden 256, 4 layers, 8 heads (4 KV), ffn 704, vocab 8192, fp32; {cores} cores")
    figures: dict = {"lengths": args.lengths, "memory": {}, "speed": {}, "speed_lengths": args.speed_lengths}
    if args.only != "speed":
        memory_part(args, figures)
    if args.only != "memory":
        speed_part(args, figures, cores)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    if args.plot and figures["memory"]:
        plot(figures, args.plot)


def memory_part(args, figures: dict) -> None:
    single = run_distributed(1, memory_body, {}, args.lengths)[0]
    figures["memory"]["single"] = single
    print("\n(a) activation bytes saved for backward per rank (max over ranks); ratio to single rank x N (ideal 1.00)")
    print(f"{'layout':<12}" + "".join(f"{n:>16}" for n in args.lengths))
    print(f"{'single':<12}" + "".join(f"{b / 2**20:>13.1f}MiB" for b in single))
    for name in args.layouts:
        make = LAYOUTS[name]
        for n in args.ranks:
            per_rank = run_distributed(n, memory_body, make(n), args.lengths)
            worst = [max(r[i] for r in per_rank) for i in range(len(args.lengths))]
            figures["memory"][f"{name}{n}"] = worst
            cells = "".join(f"{w / 2**20:>8.1f}MiB {w * n / s:>4.2f}" for w, s in zip(worst, single))
            print(f"{name + str(n):<12}{cells}")


def speed_part(args, figures: dict, cores: int) -> None:
    print("\n(b) training step tokens/s (fwd+bwd+finalize, one thread per rank); efficiency = speed-up / N")
    base = run_distributed(1, speed_body, {}, args.speed_lengths, args.repeats)[0]
    figures["speed"]["single"] = base
    print(f"{'layout':<12}" + "".join(f"{n:>22}" for n in args.speed_lengths))
    print(f"{'single':<12}" + "".join(f"{n / t:>12.0f} tok/s     " for n, t in zip(args.speed_lengths, base)))
    for name in args.layouts:
        make = LAYOUTS[name]
        for n in args.ranks:
            if n > cores:
                continue
            times = run_distributed(n, speed_body, make(n), args.speed_lengths, args.repeats)[0]
            figures["speed"][f"{name}{n}"] = times
            cells = "".join(f"{length / t:>10.0f} tok/s eff {b / t / n:>4.2f}"
                            for length, t, b in zip(args.speed_lengths, times, base))
            print(f"{name + str(n):<12}{cells}")


def plot(figures: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = figures["lengths"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in figures["memory"].items():
        style = "k-" if name == "single" else ("--" if name.endswith("4") else "-")
        ax.plot(lengths, [v / 2**20 for v in values], style, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("activation memory saved for backward per rank (MiB)")
    ax.set_title("Activation memory per rank vs sequence length")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
