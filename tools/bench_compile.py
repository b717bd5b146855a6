"""Training-step speed of ``compile=True`` (each decoder layer through torch.compile, inductor) against
the eager model, on CPU, one process, measured in the same run.

    .venv/bin/python tools/bench_compile.py [--hidden 512 --layers 4 --tokens 2048 --steps 8]

Both models are built from the same random weights (a Qwen2 shape); each runs ``--warmup`` steps
first (the compiled one compiles there: that time is reported separately) and then ``--steps``
timed forward + backward + SGD steps on a packed batch. Prints tokens/s of each, the speed-up
(compiled / eager), the compile time, and the largest loss difference between the two over the
timed steps. Figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per step (packed, 4 sequences)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import Qwen2Config

    from models.qwen2 import build_parallel_model

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=max(1, args.heads // 4), max_position_embeddings=args.tokens)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    quarter = args.tokens // 4
    cu = torch.tensor([0, quarter, 2 * quarter, 3 * quarter, args.tokens])
    print(f"Qwen2 shape: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {args.tokens} tokens "
          f"per step (4 packed sequences); torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    results = {}
    for name, compile_flag in (("eager", False), ("compiled", True)):
        model = build_parallel_model(cfg, seed=1, compile=compile_flag)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(model=model, opt=opt) -> float:
            opt.zero_grad()
            loss = model(ids, cu_seqlens=cu, labels=ids, return_logits=False).loss
            loss.backward()
            opt.step()
            return loss.item()

        t0 = time.perf_counter()
        for _ in range(args.warmup):
            step()
        warm = time.perf_counter() - t0
        times, losses = [], []
        for _ in range(args.steps):
            t = time.perf_counter()
            losses.append(step())
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        results[name] = (med, warm, losses)
        print(f"  {name:9s} {args.tokens / med:10.0f} tokens/s   median step {med * 1e3:8.1f} ms   "
              f"warm-up ({args.warmup} steps) {warm:6.1f} s", flush=True)
    eager, compiled = results["eager"], results["compiled"]
    print(f"speed-up (compiled / eager tokens/s): {eager[0] / compiled[0]:.2f}x; compile time ~"
          f"{compiled[1] - eager[1]:.0f} s; max |loss difference| over the timed steps: "
          f"{max(abs(a - b) for a, b in zip(eager[2], compiled[2])):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
