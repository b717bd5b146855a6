r"""Training-throughput benchmark: our Qwen2 (TP=1) against transformers' Qwen2ForCausalLM.

What it measures
    Forward + backward tokens/s of one training step (zero grads, forward with labels,
    ``loss.backward()``) for
      * ours:      ``models.qwen2.build_parallel_model(config)`` at TP=1 (single process, no
                   torch.distributed), called as ``model(ids, labels=labels, return_logits=False)``;
      * hf-eager:  ``transformers.Qwen2ForCausalLM`` with ``attn_implementation="eager"``;
      * hf-sdpa:   the same with ``attn_implementation="sdpa"``;
    all fp32, on CPU, with the SAME config, the SAME weights (ours are built from deterministic
    random weights, then exported by ``iter_hf_weights`` and loaded into both transformers models)
    and the SAME input ids and labels. No optimizer step: only the forward/backward is timed.

    Measurement is interleaved step by step: each round runs ONE step of each model, the order
    rotating from round to round, and ``--steps`` rounds are timed after ``--warmup`` untimed steps
    per model. Reported: each model's median step time (tokens/s = batch*seq / median) and, for
    the ratios, the median over rounds of the per-round ratio t_hf / t_ours of steps that ran
    back to back. Small shared VMs change speed by 2-4x for seconds at a time (another tenant,
    CPU throttling); pairing adjacent steps cancels most of that, comparing medians of separate
    blocks does not. Before timing, the losses (|Δloss|) and the gradients of ours against
    hf-eager are compared once, to show the comparison is of equal computations.

How to run
    . .venv/bin/activate
    python tools/bench_model.py                          # default small-but-realistic config
    python tools/bench_model.py --hidden 896 --layers 4 --heads 14 --kv-heads 2 --ffn 4864 \
        --vocab 151936 --batch 2 --seq 512 --steps 4    # Qwen2-0.5B-shaped layers
    python tools/bench_model.py --model-dir /path/to/hf_qwen2   # a saved HF model dir (size flags ignored)

    The last line is machine-readable: ``ratio_vs_eager=X ratio_vs_sdpa=Y`` (ours/transformers
    tokens/s; > 1 means ours is faster). The default config finishes in about 1-3 minutes on 2 cores.
    On a small VM whose vCPUs share one physical core, libgomp's spin-waiting can make every
    parallel op cost a few ms; ``OMP_WAIT_POLICY=PASSIVE python tools/bench_model.py`` (or
    ``--threads 1``) avoids that without changing which model is faster.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=int, default=512, help="hidden_size")
    p.add_argument("--layers", type=int, default=4, help="num_hidden_layers")
    p.add_argument("--heads", type=int, default=8, help="num_attention_heads")
    p.add_argument("--kv-heads", type=int, default=2, help="num_key_value_heads")
    p.add_argument("--ffn", type=int, default=1408, help="intermediate_size")
    p.add_argument("--vocab", type=int, default=32000, help="vocab_size")
    p.add_argument("--tied", action="store_true", help="tie_word_embeddings=True")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=6, help="timed steps per model (interleaved rounds)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per model before timing (>= 1)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and input ids")
    p.add_argument("--model-dir", default=None,
                   help="load ours and transformers' from this saved HF Qwen2 directory (size flags ignored)")
    return p.parse_args(argv)


def build_models(args):
    """(name -> model) for ours, hf-eager and hf-sdpa, all fp32 with identical weights; and the HF config."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from models.qwen2 import build_parallel_model

    if args.model_dir:
        ours = build_parallel_model(args.model_dir)
        hf = {impl: Qwen2ForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation=impl)
              for impl in ("eager", "sdpa")}
        config = hf["eager"].config
    else:
        config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                             num_hidden_layers=args.layers, num_attention_heads=args.heads,
                             num_key_value_heads=args.kv_heads, max_position_embeddings=max(4096, args.seq),
                             tie_word_embeddings=args.tied, rms_norm_eps=1e-6)
        ours = build_parallel_model(config, seed=args.seed)
        # Our deterministic random weights, in HF names and full shapes, into both transformers models.
        state = {name: t.detach().clone() for name, t in ours.iter_hf_weights()}
        hf = {}
        for impl in ("eager", "sdpa"):
            # A config copy per model: transformers records attn_implementation on the config object.
            m = Qwen2ForCausalLM._from_config(copy.deepcopy(config), attn_implementation=impl, dtype=torch.float32)
            missing, unexpected = m.load_state_dict(state, strict=False)
            missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
            if missing or unexpected:
                raise RuntimeError(f"weight transfer to transformers failed: missing={missing} unexpected={unexpected}")
            if config.tie_word_embeddings:
                m.tie_weights()
            hf[impl] = m
    for impl, m in hf.items():
        assert m.config._attn_implementation == impl, (impl, m.config._attn_implementation)
    models = {"ours": ours, "hf-eager": hf["eager"], "hf-sdpa": hf["sdpa"]}
    for m in models.values():
        m.float().train()  # dropout is 0 in Qwen2; train() only matters for code paths that check it
    return models, config


def make_step(name, model, ids, labels):
    if name == "ours":
        def step():
            model.zero_grad(set_to_none=True)
            loss = model(ids, labels=labels, return_logits=False).loss
            loss.backward()
            return loss
    else:
        def step():
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
            loss.backward()
            return loss
    return step


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    t0 = time.perf_counter()
    models, config = build_models(args)
    t_build = time.perf_counter() - t0
    vocab = config.vocab_size
    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
    labels = ids.clone()  # transformers semantics: shifted inside both models
    tokens = args.batch * args.seq
    steps = {name: make_step(name, m, ids, labels) for name, m in models.items()}

    n_params = sum(p.numel() for p in models["ours"].parameters())
    print(f"config: hidden={config.hidden_size} layers={config.num_hidden_layers} heads={config.num_attention_heads} "
          f"kv_heads={config.num_key_value_heads} ffn={config.intermediate_size} vocab={vocab} "
          f"tied={config.tie_word_embeddings} params={n_params / 1e6:.1f}M")
    print(f"run:    batch={args.batch} seq={args.seq} tokens/step={tokens} fp32 cpu threads={torch.get_num_threads()} "
          f"warmup={args.warmup} steps={args.steps} torch={torch.__version__} "
          f"(build {t_build:.1f}s)")

    # Equal computations: one step each from the same weights; also the warm-up.
    losses = {}
    for name, step in steps.items():
        losses[name] = step().item()
        for _ in range(args.warmup - 1):
            step()
    ref = losses["hf-eager"]
    print("loss:   " + "  ".join(f"{n}={v:.6f}" for n, v in losses.items())
          + f"  |Δloss| ours-eager={abs(losses['ours'] - ref):.2e}"
          + f" ours-sdpa={abs(losses['ours'] - losses['hf-sdpa']):.2e}")
    g = {n: p.grad for n, p in models["ours"].named_parameters()}
    ours_grads = dict(models["ours"].iter_hf_weights(g))
    hf_params = dict(models["hf-eager"].named_parameters())
    max_grad_diff = max(float((ours_grads[n] - hf_params[n].grad).abs().max()) for n in ours_grads)
    print(f"grads:  max |Δgrad| ours-eager over {len(ours_grads)} tensors = {max_grad_diff:.2e}")

    # Interleaved rounds of one step per model, rotating the order so no model always runs first/last.
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(args.steps):
            for name in names[r % len(names):] + names[: r % len(names)]:
                t0 = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - t0)
    finally:
        gc.enable()

    med = {n: statistics.median(t) for n, t in times.items()}
    paired = {n: statistics.median(h / o for h, o in zip(times[n], times["ours"])) for n in names}
    print()
    print(f"{'model':<9} {'median s/step':>13} {'min':>7} {'max':>7} {'tokens/s':>9} "
          f"{'ours/this (medians)':>20} {'(paired)':>9}")
    for n in names:
        t = times[n]
        print(f"{n:<9} {med[n]:>13.3f} {min(t):>7.3f} {max(t):>7.3f} {tokens / med[n]:>9.0f} "
              f"{med[n] / med['ours']:>19.2f}x {paired[n]:>8.2f}x")
    print("per step s: " + "  ".join(f"{n}=[{' '.join(f'{x:.2f}' for x in times[n])}]" for n in names))
    print(f"\nwall time {time.perf_counter() - t_start:.1f}s ({args.steps} timed steps per model)")
    print(f"ratio_vs_eager={paired['hf-eager']:.2f} ratio_vs_sdpa={paired['hf-sdpa']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
