"""Live-export throughput per rank: ``iter_export("hf")`` from a TP2 x PP2 CPU job (gloo).

Per rank, in the same run: (a) bytes of full HF tensors received per second by ``iter_export`` for
several bucket sizes, (b) a plain single-threaded copy of the same number of bytes (the memcpy
rate: the ceiling for moving the model once), (c) ``iter_hf_weights`` (the TP-only gather that
existed before: each rank gets only its own stage's tensors), per byte it delivers. Ratios are
against (b) measured on the same rank.

    .venv/bin/python tools/bench_export.py [--hidden 1024 --layers 16]   # ~1 GB fp32 by default
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from parallel import ParallelConfig  # noqa: E402
from parallel.launch import run_distributed  # noqa: E402


def model_config(hidden: int, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 64 * 64,
                       num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                       tie_word_embeddings=False)


def body(hidden: int, layers: int, buckets_mb: list[int], repeats: int) -> dict:
    import torch.distributed as dist

    from models.llama import build_parallel_model

    model = build_parallel_model(model_config(hidden, layers), ParallelConfig(tp=2, pp=2), seed=0)
    result: dict = {}
    for mb in buckets_mb:
        times, total = [], 0
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            total = sum(b.nbytes for b in model.iter_export("hf", bucket_bytes=mb << 20))
            times.append(time.perf_counter() - start)
        result[f"export_{mb}MB"] = (total, statistics.median(times))
    src = torch.empty(total // 4, dtype=torch.float32).normal_()
    dst = torch.zeros_like(src)  # pages touched before timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    result["memcpy"] = (total, statistics.median(times))
    del src, dst
    times, got = [], 0
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        got = sum(t.numel() * t.element_size() for _, t in model.iter_hf_weights())
        times.append(time.perf_counter() - start)
    result["iter_hf_weights"] = (got, statistics.median(times))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--buckets-mb", type=int, nargs="+", default=[16, 64, 256, 512])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    per_rank = run_distributed(4, body, args.hidden, args.layers, args.buckets_mb, args.repeats)
    total = per_rank[0]["memcpy"][0]
    print(f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab 32000, fp32 = {total / 1e9:.2f} GB; "
          f"TP2 x PP2 on gloo/CPU, one thread per rank; medians of {args.repeats}")
    print(f"{'what':<22}{'GB/s per rank (min..max over ranks)':>40}{'vs memcpy':>12}")
    memcpy = [r["memcpy"][0] / r["memcpy"][1] / 1e9 for r in per_rank]
    for key in [f"export_{mb}MB" for mb in args.buckets_mb] + ["iter_hf_weights", "memcpy"]:
        rates = [r[key][0] / r[key][1] / 1e9 for r in per_rank]
        ratio = [a / m for a, m in zip(rates, memcpy)]
        print(f"{key:<22}{min(rates):>30.2f} .. {max(rates):<6.2f}{min(ratio):>10.2f}x")


if __name__ == "__main__":
    main()
