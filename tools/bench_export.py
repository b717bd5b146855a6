"""Live-export throughput per rank: ``iter_export`` from a TP2 x PP2 CPU job (gloo).

Per rank, in the same run: (a) bytes of full HF tensors received per second by ``iter_export("hf")``
for several bucket sizes, with the collective transport, with ``transport="shm"`` reading buckets in
place, and with ``transport="shm"`` plus a copy of every bucket into memory the consumer keeps
(what an engine loading the weights pays); ``iter_export("vllm", target_tp=2)`` (vLLM rank 0's
shards) on both transports; (b) a plain single-threaded copy of the same number of bytes (the
memcpy rate: the ceiling for moving the model once), (c) ``iter_hf_weights`` (the TP-only gather that
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
    def timed(key: str, make, consume=lambda b: b.nbytes) -> int:
        times, total = [], 0
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            total = sum(consume(b) for b in make())
            times.append(time.perf_counter() - start)
        result[key] = (total, statistics.median(times))
        return total

    sink: list[torch.Tensor] = []

    def copied(bucket) -> int:  # a consumer copying into memory it keeps (like an engine's parameters)
        if not sink or sink[0].numel() < bucket.buffer.numel():
            sink[:] = [torch.zeros(bucket.buffer.numel(), dtype=bucket.buffer.dtype)]
        sink[0][:bucket.buffer.numel()].copy_(bucket.buffer)
        return bucket.nbytes

    total = 0
    for mb in buckets_mb:
        size = mb << 20
        total = timed(f"export_{mb}MB", lambda size=size: model.iter_export("hf", bucket_bytes=size))
        timed(f"shm_{mb}MB", lambda size=size: model.iter_export("hf", bucket_bytes=size, transport="shm"))
        timed(f"shm+copy_{mb}MB", lambda size=size: model.iter_export("hf", bucket_bytes=size, transport="shm"),
              copied)
    mb = buckets_mb[len(buckets_mb) // 2]
    timed(f"vllm_tp2_{mb}MB", lambda: model.iter_export("vllm", bucket_bytes=mb << 20, target_tp=2, target_rank=0))
    timed(f"vllm_tp2_shm_{mb}MB", lambda: model.iter_export("vllm", bucket_bytes=mb << 20, target_tp=2, target_rank=0,
                                                             transport="shm"))
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size of the Llama (fp32; 16 heads, 4 KV)")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (a multiple of pp=2)")
    parser.add_argument("--buckets-mb", type=int, nargs="+", default=[16, 64, 256],
                        help="iter_export bucket sizes (MiB) to time; the middle one is used for the vLLM rows")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions per row (median)")
    args = parser.parse_args()
    per_rank = run_distributed(4, body, args.hidden, args.layers, args.buckets_mb, args.repeats)
    total = per_rank[0]["memcpy"][0]
    print(f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab 32000, fp32 = {total / 1e9:.2f} GB; "
          f"TP2 x PP2 on gloo/CPU, one thread per rank; medians of {args.repeats}")
    print(f"{'what':<22}{'GB/s per rank (min..max over ranks)':>40}{'vs memcpy':>12}")
    memcpy = [r["memcpy"][0] / r["memcpy"][1] / 1e9 for r in per_rank]
    keys = [k for k in per_rank[0] if k not in ("iter_hf_weights", "memcpy")] + ["iter_hf_weights", "memcpy"]
    for key in keys:
        rates = [r[key][0] / r[key][1] / 1e9 for r in per_rank]
        ratio = [a / m for a, m in zip(rates, memcpy)]
        print(f"{key:<22}{min(rates):>30.2f} .. {max(rates):<6.2f}{min(ratio):>10.2f}x")


if __name__ == "__main__":
    main()
