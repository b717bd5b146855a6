r"""Step memory of the LM head + loss: the fused, chunked head against full logits and transformers.

What it measures
    The memory one training step (forward with labels + ``loss.backward()``, no optimizer) takes
    over and above the weights and gradients, for a Qwen2-shaped model with a real vocabulary
    (default: hidden 512, 2 layers, vocab 151936, 4 x 1024 = 4096 tokens, fp32, CPU, one process):
      * transformers: ``Qwen2ForCausalLM`` (sdpa), ``model(ids, labels=ids).loss``;
      * ours-full:    ``model(ids, labels=ids, return_logits=True)`` (logits asked for: the loss
                      comes from full ``[tokens, vocab]`` fp32 logits, the path before the fused head);
      * ours-chunked: ``model(ids, labels=ids, return_logits=False)`` (the fused head,
                      ``parallel/lm_head_loss.py``, default chunk from its byte budget);
      * ours-plain:   ``model(ids, labels=ids)``, nothing else, on the model in training mode (the
                      default call: a training step takes the fused head and returns no logits);
      * ours-step:    ``model.forward_backward(ids, ids)`` (the training step API, fused head).
    Each variant runs in a process of its own (child processes of this script), so one variant's
    freed memory cannot hide another's. In the child: build the model (random weights), run one
    warm-up step (gradients now exist), zero the gradients in place, release
    freed heap pages (``malloc_trim``), read ``VmRSS``, reset the peak (``/proc/self/clear_refs``
    = 5), run one step, read ``VmHWM``: step memory = peak - RSS before the step, whole process.
    Then ``--steps`` more steps are timed (median -> tokens/s). Ratios are against transformers
    measured in the same run. Linux only (``/proc``).

    Speed of the fused head (``--paired-rounds N``, default 3): in one more process, our model
    alternates ours-full and ours-chunked steps (order swapped every round) and reports the median
    of the per-round time ratios chunked / full. On a shared machine whose speed swings for seconds
    at a time, this pairing is the figure to trust; the per-variant tokens/s above come from
    separate processes at different moments.

How to run
    .venv/bin/python tools/bench_loss_memory.py                 # ~2-4 min on 2 cores, ~9 GB free RAM
    .venv/bin/python tools/bench_loss_memory.py --chunk 1024    # another chunk size for ours
    The last line is machine-readable: ``chunked_vs_transformers=R full_vs_transformers=R``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = ("transformers", "ours-full", "ours-chunked", "ours-plain", "ours-step")
PAIRED = "paired-speed"


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _release_and_reset_peak() -> int:
    """Free what can be freed, reset the peak RSS, and return the RSS now."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def config(args):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, max_position_embeddings=max(4096, args.seq),
                       tie_word_embeddings=False, attn_implementation="sdpa")


def child(args) -> dict:
    """One variant in this process: step memory and tokens/s."""
    import torch

    torch.set_num_threads(args.threads)
    cfg = config(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    if args.variant == "transformers":
        from transformers import Qwen2ForCausalLM

        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg).float()

        def step():
            return model(ids, labels=ids).loss
    else:
        from models.qwen2 import build_parallel_model

        model = build_parallel_model(cfg, loss_chunk_tokens=args.chunk)

        def step():
            if args.variant == "ours-step":
                return model.forward_backward(ids, ids)
            if args.variant == "ours-plain":  # the plain training call: no return_logits
                out = model(ids, labels=ids)
                assert out.logits is None, "a training-mode call with labels built full logits"
                return out.loss
            return model(ids, labels=ids, return_logits=args.variant == "ours-full").loss
    model.train()
    params = sum(p.numel() * p.element_size() for p in model.parameters())

    def run():
        loss = step()
        if args.variant != "ours-step":  # forward_backward runs its own backward
            loss.backward()
        return float(loss)

    loss = run()  # warm-up: gradients exist from here on
    model.zero_grad(set_to_none=False)
    before = _release_and_reset_peak()
    t0 = time.perf_counter()
    run()
    times = [time.perf_counter() - t0]
    peak = _status("VmHWM")
    for _ in range(args.steps - 1):
        model.zero_grad(set_to_none=False)
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    tokens = args.batch * args.seq
    return {"variant": args.variant, "step_bytes": peak - before, "rss_before": before, "param_bytes": params,
            "loss": loss, "s_per_step": statistics.median(times), "tokens_per_s": tokens / statistics.median(times)}


def paired(args) -> dict:
    """Our model, full-logits and fused steps alternating: per-round time ratios chunked / full."""
    import torch

    from models.qwen2 import build_parallel_model

    torch.set_num_threads(args.threads)
    model = build_parallel_model(config(args), loss_chunk_tokens=args.chunk)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def timed(full: bool) -> float:
        model.zero_grad(set_to_none=False)
        t0 = time.perf_counter()
        model(ids, labels=ids, return_logits=full).loss.backward()
        return time.perf_counter() - t0

    timed(True), timed(False)  # warm-up
    ratios, times = [], {"full": [], "chunked": []}
    for r in range(args.paired_rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {full: timed(full) for full in order}
        times["full"].append(got[True])
        times["chunked"].append(got[False])
        ratios.append(got[False] / got[True])
    return {"variant": PAIRED, "ratio": statistics.median(ratios), "ratios": ratios, "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=None, help="loss_chunk_tokens for ours (default: its budget)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (the first also measures memory)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--paired-rounds", type=int, default=3,
                        help="rounds of the paired full/chunked speed comparison (0: skip)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # set in the child processes
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(paired(args) if args.variant == PAIRED else child(args)), flush=True)
        return
    variants = [v for v in args.variants.split(",") if v]  # "" runs only the paired comparison
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)} (choose from {', '.join(VARIANTS)})")
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                   if k not in ("variants", "variant", "json") and v is not None]
    results = {}
    print(f"[bench_loss_memory] vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
          f"{args.batch} x {args.seq} tokens, fp32, {args.threads} threads; one process per variant", flush=True)
    for variant in variants:
        out = subprocess.run([sys.executable, __file__, *passthrough, "--variant", variant], capture_output=True,
                             text=True)
        if out.returncode:
            sys.exit(f"bench_loss_memory: {variant} failed: {out.stderr.strip().splitlines()[-1:]}")
        results[variant] = r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  {variant:13s} step memory {r['step_bytes'] / 2**30:6.2f} GiB   {r['tokens_per_s']:8.0f} tokens/s   "
              f"loss {r['loss']:.6f}   (weights {r['param_bytes'] / 2**30:.2f} GiB)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    base = results.get("transformers")
    if base:
        ratios = {v: r["step_bytes"] / base["step_bytes"] for v, r in results.items()}
        speed = {v: r["tokens_per_s"] / base["tokens_per_s"] for v, r in results.items()}
        for v in results:
            print(f"  {v:13s} memory {ratios[v]:.2f}x transformers, speed {speed[v]:.2f}x")
    if args.paired_rounds > 0:
        out = subprocess.run([sys.executable, __file__, *passthrough, "--variant", PAIRED], capture_output=True,
                             text=True)
        if out.returncode:
            sys.exit(f"bench_loss_memory: {PAIRED} failed: {out.stderr.strip().splitlines()[-1:]}")
        results[PAIRED] = p = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  paired steps (one process): chunked / full step time, median of {len(p['ratios'])} rounds "
              f"{p['ratio']:.2f}x (rounds: {', '.join(f'{r:.2f}' for r in p['ratios'])})")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    if base:
        print(" ".join(f"{v.replace('ours-', '')}_vs_transformers={ratios[v]:.3f}" for v in ratios
                       if v != "transformers"))


if __name__ == "__main__":
    main()
