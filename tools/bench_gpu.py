"""Training throughput on one GPU: ours (eager and ``compile=True``) against transformers (sdpa, and
flash_attention_2 where the flash-attn package is installed) and megatron-core's GPTModel (local
spec) on the same GPU, in the same run.

    .venv/bin/python tools/bench_gpu.py                     # Qwen2-1.5B shape, bf16, 4096 tokens/step
    .venv/bin/python tools/bench_gpu.py --smoke             # tiny shape on CPU: checks the script runs

Every variant runs in a process of its own (peak memory is that variant's alone): the same random
Qwen2-1.5B-shaped weights (hidden 1536, 28 layers, 12 heads / 2 KV heads, MLP 8960, vocab 151936),
bf16, AdamW, one step = forward + backward + optimizer step on 4096 tokens: 4 sequences of 1024,
packed (``cu_seqlens``) for ours and for transformers' flash_attention_2, a ``[4, 1024]`` batch for
sdpa and megatron-core (the same attention work). ``--warmup`` steps (compilation included) are not
timed; then the median of ``--steps``.

MFU = model FLOPs per second / the GPU's peak dense bf16 FLOP/s (``--peak-tflops``, default from the
device name: H100/H200 989). Model FLOPs per token: 6 x the parameters of every matrix multiply
(attention and MLP projections, the LM head; embeddings are lookups) plus attention's own
3 x 4 x layers x heads x head_dim x the mean causal context ((1024 + 1) / 2 here).

Prints one line per variant and the ratios against transformers (sdpa); figures go to
docs/benchmarks.md. Never claim a figure this script did not print on the named GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936)
SHAPE_SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512)
VARIANTS = ("ours", "ours-compiled", "hf-sdpa", "hf-flash2", "megatron")
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU (fp32): the script's own check")
    p.add_argument("--seqs", type=int, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant in this process
    return p.parse_args(argv)


def model_flops_per_token(shape: dict, seq_len: int) -> float:
    h, f, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    linear = L * (h * (heads + 2 * kv) * d + heads * d * h + 3 * h * f) + h * shape["vocab_size"]
    attention = 3 * 4 * L * heads * d * (seq_len + 1) / 2
    return 6 * linear + attention


def _batch(shape: dict, args, device):
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (args.seqs, args.seq_len), generator=gen).to(device)
    cu = torch.arange(args.seqs + 1, dtype=torch.int32, device=device) * args.seq_len
    return ids, cu


def _hf_config(shape: dict, args):
    from transformers import Qwen2Config

    return Qwen2Config(**shape, max_position_embeddings=args.seq_len, tie_word_embeddings=False)


def _step_fn(variant: str, shape: dict, args, device, dtype):
    """(model, one training step) for ``variant``."""
    import torch

    ids, cu = _batch(shape, args, device)
    if variant.startswith("ours"):
        from models.qwen2 import build_parallel_model

        model = build_parallel_model(_hf_config(shape, args), dtype=dtype, device=device,
                                     compile=variant == "ours-compiled")
        flat = ids.reshape(-1)

        def run():
            return model(flat, cu_seqlens=cu, labels=flat, return_logits=False).loss
    elif variant.startswith("hf"):
        from transformers import AutoModelForCausalLM

        impl = "flash_attention_2" if variant == "hf-flash2" else "sdpa"
        model = AutoModelForCausalLM.from_config(_hf_config(shape, args), attn_implementation=impl,
                                                 dtype=dtype).to(device)
        if impl == "flash_attention_2":  # packed: one row, positions restart per sequence
            flat = ids.reshape(1, -1)
            pos = torch.arange(args.seq_len, device=device).repeat(args.seqs)[None]

            def run():
                return model(input_ids=flat, position_ids=pos, labels=flat).loss
        else:
            def run():
                return model(input_ids=ids, labels=ids).loss
    elif variant == "megatron":
        model, run = _megatron(shape, args, device, dtype, ids)
    else:
        raise SystemExit(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = run()
        loss.backward()
        opt.step()
        return float(loss.detach())

    return model, step


def _megatron(shape: dict, args, device, dtype, ids):
    """megatron-core GPTModel, local (non-TE) spec, one rank; labels are the next tokens."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if device.type == "cpu":  # --smoke: megatron-core's CUDA-only calls replaced, as the test oracle does
        from tests.megatron_oracle import apply_cpu_shims

        apply_cpu_shims()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(num_layers=shape["num_hidden_layers"], hidden_size=shape["hidden_size"],
                            ffn_hidden_size=shape["intermediate_size"],
                            num_attention_heads=shape["num_attention_heads"],
                            num_query_groups=shape["num_key_value_heads"], normalization="RMSNorm",
                            gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
                            add_qkv_bias=True, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                            use_cpu_initialization=device.type != "cuda", hidden_dropout=0.0, attention_dropout=0.0,
                            bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                            masked_softmax_fusion=device.type == "cuda", apply_rope_fusion=False)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=shape["vocab_size"],
                     max_sequence_length=args.seq_len, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).to(device)
    pos = torch.arange(args.seq_len, device=device)[None].expand_as(ids)
    labels = torch.roll(ids, -1, dims=1)

    def run():
        return model(ids, pos, None, labels=labels).float().mean()

    return model, run


def run_variant(variant: str, args) -> dict:
    import torch

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shape = SHAPE_SMOKE if args.smoke else SHAPE_1_5B
    if variant == "hf-flash2":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            return {"variant": variant, "skipped": "flash-attn is not installed"}
    torch.manual_seed(0)
    model, step = _step_fn(variant, shape, args, device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync()
    warm = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t)
    tokens = args.seqs * args.seq_len
    med = statistics.median(times)
    out = {"variant": variant, "tokens_per_s": tokens / med, "step_s": med, "warmup_s": warm, "loss": loss,
           "params": sum(p.numel() for p in model.parameters())}
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["device"] = torch.cuda.get_device_name()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args.variant, args)), flush=True)
        return 0
    shape = SHAPE_SMOKE if args.smoke else SHAPE_1_5B
    flops = model_flops_per_token(shape, args.seq_len)
    results = {}
    for variant in args.variants.split(","):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--variant", variant, "--seqs", str(args.seqs),
               "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        cmd += ["--smoke"] if args.smoke else []
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            print(f"  {variant:14s} FAILED (exit {proc.returncode}): {tail[0]}", flush=True)
            continue
        res = json.loads(lines[-1][len("RESULT "):])
        results[variant] = res
        if "skipped" in res:
            print(f"  {variant:14s} skipped: {res['skipped']}", flush=True)
            continue
        device = res.get("device", "cpu (smoke)")
        peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
        mfu = f"{100 * res['tokens_per_s'] * flops / (peak * 1e12):5.1f}%" if peak else "  n/a"
        mem = f"{res['peak_gib']:6.1f} GiB" if "peak_gib" in res else "     n/a"
        res["mfu"] = mfu
        print(f"  {variant:14s} {res['tokens_per_s']:10.0f} tokens/s  MFU {mfu}  peak {mem}  "
              f"loss {res['loss']:.4f}  ({device})", flush=True)
    base = results.get("hf-sdpa")
    if base and "tokens_per_s" in base:
        for variant, res in results.items():
            if variant != "hf-sdpa" and "tokens_per_s" in res:
                print(f"{variant} / transformers (sdpa): {res['tokens_per_s'] / base['tokens_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
