"""Train a tiny Qwen2 on synthetic data with any TP/PP/VPP/CP/Ulysses/DP layout (torchrun-ready).

    torchrun --standalone --nproc-per-node 4 tools/train.py --tp 2 --pp 2 --steps 20
    python tools/train.py --pp 2 --vpp 2 --dp 1          # spawns tp*ulysses*cp*pp*dp gloo processes itself
    python tools/train.py --cp 2 --ulysses 2 --fsdp --dp 1 --recompute full
    python tools/train.py --tp 2 --loss-log runs/tp2.log # also write the per-step loss to a file

Each step: the global batch (``--batch`` samples of random lengths, a learnable synthetic task:
the next token is (token * 3 + 1) mod vocab) is split over DP ranks, ``forward_backward`` runs it
in ``--microbatches`` balanced micro-batches with ``--schedule``, AdamW steps. Rank 0 shows a
progress bar with the current loss and prints the final loss. No file is written unless
``--loss-log PATH`` is given: then rank 0 writes one ``step loss`` line per step there (parent
folders are created; a relative path is relative to the current directory; ``runs/`` is
gitignored for this). Under torchrun the world size comes from torchrun (``--dp`` is derived);
option names are never abbreviated, so none of them can be taken for one of torchrun's own
(torchrun prefix-matches, e.g. a ``--log`` after the script name fails as ambiguous with its
``--log-dir`` / ``--logs-specs``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.qwen2 import build_parallel_model  # noqa: E402
from parallel import ParallelConfig  # noqa: E402
from parallel.launch import run_distributed  # noqa: E402
from parallel.pipeline import MULTI_STAGE, SCHEDULES  # noqa: E402


def synthetic_batch(step: int, batch: int, max_len: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed samples of random lengths following a deterministic rule the model can learn."""
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    lengths = torch.randint(max_len // 2, max_len + 1, (batch,), generator=gen)
    samples = []
    for n in lengths.tolist():
        x = torch.empty(n, dtype=torch.long)
        x[0] = torch.randint(0, vocab, (1,), generator=gen)
        for t in range(1, n):
            x[t] = (x[t - 1] * 3 + 1) % vocab
        samples.append(x)
    cu = torch.tensor([0, *lengths.tolist()]).cumsum(0)
    return torch.cat(samples), cu


def train(args: argparse.Namespace) -> None:
    from transformers import Qwen2Config

    rank = dist.get_rank()
    pconfig = ParallelConfig(tp=args.tp, pp=args.pp, vpp=args.vpp, sequence_parallel=args.tp > 1, cp=args.cp,
                             ulysses=args.ulysses, cp_comm=args.cp_comm, fsdp=args.fsdp, recompute=args.recompute)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    model = build_parallel_model(config, pconfig, seed=args.seed, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    groups = model.groups
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc=f"train {pconfig.describe()} dp={groups.dp_size}", unit="step")
    log = None
    if rank == 0 and args.loss_log:
        Path(args.loss_log).parent.mkdir(parents=True, exist_ok=True)
        log = open(args.loss_log, "w")
    start = time.perf_counter()
    for step in range(args.steps):
        flat, cu = synthetic_batch(step, args.batch, args.seq, args.vocab, args.seed)
        # this DP rank's share of the samples
        per = args.batch // groups.dp_size
        lo, hi = groups.dp_rank * per, (groups.dp_rank + 1) * per
        ids = flat[cu[lo]:cu[hi]]
        local_cu = cu[lo:hi + 1] - cu[lo]
        if device is not None:
            ids = ids.to(device)
        opt.zero_grad()
        loss = model.forward_backward(ids, ids, cu_seqlens=local_cu, num_microbatches=args.microbatches,
                                      schedule=args.schedule)
        opt.step()
        if rank == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
            bar.update(1)
            if log:
                log.write(f"{step} {loss.item():.6f}\n")
                log.flush()
    if log:
        log.close()
    if rank == 0:
        bar.close()
        print(f"final loss {loss.item():.4f} after {args.steps} steps in {time.perf_counter() - start:.1f}s")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the empty ones of switches and optional paths."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=_HelpFormatter)
    layout = p.add_argument_group("parallel layout (world size = tp * ulysses * cp * pp * dp)")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel size (sequence parallelism on when > 1)")
    layout.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages)")
    layout.add_argument("--vpp", type=int, default=1,
                        help="virtual pipeline chunks per stage (> 1 needs an interleaved --schedule)")
    layout.add_argument("--cp", type=int, default=1, help="context-parallel size (ring attention)")
    layout.add_argument("--cp-comm", default="ring", choices=["ring", "allgather"],
                        help="how context-parallel ranks exchange keys/values")
    layout.add_argument("--ulysses", type=int, default=1, help="Ulysses sequence-parallel size")
    layout.add_argument("--fsdp", action="store_true", help="FSDP2 over the dp x cp x ulysses ranks")
    layout.add_argument("--recompute", default="none", choices=["none", "full"],
                        help="activation recomputation: full checkpoints every decoder layer")
    layout.add_argument("--dp", type=int, default=1,
                        help="data-parallel size when this script spawns the processes (under torchrun: "
                             "derived from the world size, this flag is ignored)")
    run = p.add_argument_group("training")
    run.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                     help=f"pipeline schedule; with --vpp > 1 one of {', '.join(MULTI_STAGE)}")
    run.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    run.add_argument("--steps", type=int, default=30, help="optimizer steps")
    run.add_argument("--batch", type=int, default=8, help="global batch (samples), split over DP")
    run.add_argument("--seq", type=int, default=32, help="max sample length (tokens; samples are max/2..max)")
    run.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    run.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the synthetic data")
    run.add_argument("--loss-log", metavar="PATH", default=None,
                     help="write one 'step loss' line per step to this file (rank 0); without it no file is written")
    model = p.add_argument_group("model (a tiny random Qwen2: 4 heads, 2 KV heads, tied embeddings)")
    model.add_argument("--layers", type=int, default=4, help="decoder layers")
    model.add_argument("--hidden", type=int, default=64, help="hidden size (the MLP is twice as wide)")
    model.add_argument("--vocab", type=int, default=128, help="vocabulary size")
    args = p.parse_args()
    if "RANK" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            train(args)
        finally:
            dist.destroy_process_group()
        return
    run_distributed(args.tp * args.ulysses * args.cp * args.pp * args.dp, train, args)


if __name__ == "__main__":
    main()
