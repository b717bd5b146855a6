"""Pipeline bubble per schedule, measured, against theory: ``python tools/bench_pipeline.py``.

Spawns ``--pp`` gloo processes (one thread each; keep pp <= cores so stages do not share a core).
For each schedule and micro-batch count m it measures, on every stage:
  busy = m x (this stage's forward+backward time for one micro-batch, measured alone in this run)
  wall = time of one ``forward_backward`` step under the schedule
  bubble = 1 - busy / wall
and prints the mean over stages beside the theory: (p-1)/(m+p-1) for GPipe/1F1B, and
(p-1)/(v*m+p-1) for interleaved 1F1B with v chunks per stage (Megatron's (p-1)/(v*m) bubble
relative to compute, expressed as a share of the step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.common.training.microbatches import pack, to_samples  # noqa: E402
from models.common.training.pipeline_chunk import PipelineChunk  # noqa: E402
from models.qwen2 import build_parallel_model  # noqa: E402
from parallel import ParallelConfig  # noqa: E402
from parallel.launch import run_distributed  # noqa: E402


def _standalone_microbatch_time(model, tokens: int, reps: int) -> float:
    """Forward+backward seconds of this rank's chunks for one micro-batch, with no pipeline around it."""
    chunks = [PipelineChunk(model, v) for v in range(len(model.chunk_layers))]
    ids = torch.randint(0, model.config.vocab_size, (tokens,))
    s = to_samples(ids.reshape(1, -1), ids.reshape(1, -1), None, None)
    ids_p, pos, tgt, cu = pack(s, tokens)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for chunk in chunks:
            x = ids_p if chunk.first else torch.randn(tokens, 1, model.config.hidden_size, requires_grad=True)
            out = chunk(x, position_ids=pos, cu_seqlens=cu)
            loss = model.token_losses(out, tgt.t()).sum() if chunk.last else out.float().sum()
            loss.backward()
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def run(args) -> None:
    from transformers import Qwen2Config

    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    rows = []
    for schedule, vpp in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        model = build_parallel_model(cfg, ParallelConfig(pp=pp, vpp=vpp))
        per_mb = _standalone_microbatch_time(model, args.tokens, args.reps)
        for m in args.microbatches:
            gen = torch.Generator().manual_seed(m)
            ids = torch.randint(0, args.vocab, (m, args.tokens), generator=gen)
            walls = []
            for _ in range(args.reps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                model.forward_backward(ids, ids, num_microbatches=m, schedule=schedule)
                walls.append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
            wall = statistics.median(walls[1:])
            bubble = torch.tensor([1.0 - m * per_mb / wall])
            dist.all_reduce(bubble)
            theory = (pp - 1) / (vpp * m + pp - 1)
            rows.append((schedule, vpp, m, bubble.item() / pp, theory, wall))
    if rank == 0:
        print(f"pp={pp}, {args.layers} layers, hidden {args.hidden}, {args.tokens} tokens per micro-batch, "
              f"1 thread per stage, median of {args.reps}")
        print(f"{'schedule':<18}{'vpp':>4}{'m':>4}{'bubble measured':>17}{'theory':>9}{'step s':>9}")
        for schedule, vpp, m, measured, theory, wall in rows:
            print(f"{schedule:<18}{vpp:>4}{m:>4}{measured:>17.3f}{theory:>9.3f}{wall:>9.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pp", type=int, default=2, help="pipeline stages = gloo processes spawned (keep <= cores)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the Qwen2 (a multiple of pp * 2)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (the MLP is 3x as wide)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    p.add_argument("--tokens", type=int, default=256, help="tokens per micro-batch")
    p.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8],
                   help="micro-batch counts m to measure (each a multiple of pp for the interleaved schedule)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per point (median; one more warms up)")
    args = p.parse_args()
    run_distributed(args.pp, run, args)


if __name__ == "__main__":
    main()
