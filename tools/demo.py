"""Demo: a tiny random Qwen2 with tensor + sequence parallelism (TP=2, SP), then context parallelism.

    python tools/demo.py                      # spawns 2 gloo processes itself
    torchrun --nproc-per-node 2 tools/demo.py # or under torchrun

It writes a tiny Qwen2 with transformers' own ``save_pretrained`` (no downloads), builds the
parallel model from that directory on each rank (each rank reads only its slices), and prints
max |Δlogit| and the loss against transformers, then a few training steps of both side by side,
then the same model with context parallelism (ring attention over the ranks) on a packed batch of
sequences of unequal lengths.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' own bars off (read at its import)
if __name__ == "__main__":  # not again in the spawned processes (they import this file as __mp_main__)
    print("[demo] importing torch ...", flush=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.qwen2 import build_parallel_model  # noqa: E402
from parallel import ParallelConfig  # noqa: E402
from parallel.launch import run_distributed  # noqa: E402


def write_tiny_qwen2(directory: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # random biases/norms too, so every weight matters
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.05)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(directory)


def run(directory: str, tp: int, steps: int) -> None:
    from transformers import AutoModelForCausalLM

    rank = dist.get_rank()
    torch.set_num_threads(1)
    pconfig = ParallelConfig(tp=tp, sequence_parallel=tp > 1)
    if rank == 0:
        print(f"[demo] {dist.get_world_size()} processes up; each builds its {pconfig.describe()} shard "
              "(reading only its slices) and transformers' model", flush=True)
    model = build_parallel_model(directory, pconfig)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=gen)
    out = model(ids, labels=ids, gather_logits=True)
    ref = hf(ids, labels=ids)
    if rank == 0:
        print(f"[demo] Qwen2 {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
              f"{pconfig.describe()} on {dist.get_world_size()} gloo processes; rank 0 holds "
              f"{sum(p.numel() for p in model.parameters()):,} of "
              f"{sum(p.numel() for p in hf.parameters()):,} parameters")
        print(f"[demo] max |Δlogit| vs transformers: {(out.logits - ref.logits).abs().max().item():.2e}")
        print(f"[demo] loss: ours {out.loss.item():.6f}  transformers {ref.loss.item():.6f}")
        print("[demo] training (AdamW lr=1e-3), loss per step:   ours        transformers   ours tokens/s")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    for step in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = model(ids, labels=ids, return_logits=False).loss
        loss.backward()
        model.finalize_grads()
        opt.step()
        tokens_per_s = ids.numel() / (time.perf_counter() - start)
        ref_opt.zero_grad()
        ref_loss = hf(ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        if rank == 0:
            print(f"[demo]   step {step}: {loss.item():.6f}    {ref_loss.item():.6f}       {tokens_per_s:,.0f}",
                  flush=True)
    long_context(directory, hf)


def long_context(directory: str, hf) -> None:
    """The same (trained) transformers model against a cp=world model on a packed batch."""
    world = dist.get_world_size()
    if world == 1:
        return
    from models.common.sources import StateDictSource

    pconfig = ParallelConfig(cp=world)
    if dist.get_rank() == 0:
        print(f"[demo] rebuilding the trained model with {pconfig.describe()} (ring attention) ...", flush=True)
    tied = hf.config.tie_word_embeddings
    state = {k: v.detach() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    model = build_parallel_model((hf.config, StateDictSource(state)), pconfig)  # transformers' trained weights
    lengths = [37, 5, 61, 20]
    gen = torch.Generator().manual_seed(2)
    flat = torch.randint(0, model.config.vocab_size, (sum(lengths),), generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    with torch.no_grad():
        out = model(flat, cu_seqlens=cu, gather_logits=True)
        ref = torch.cat([hf(flat[a:b][None]).logits[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    if dist.get_rank() == 0:
        print(f"[demo] {pconfig.describe()}: packed sequences of {lengths} tokens, each rank holds "
              f"{-(-sum(lengths) // world)} of them; max |Δlogit| vs transformers: "
              f"{(out.logits[0] - ref).abs().max().item():.2e}")
        print("[demo] done; stopping the processes ...", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tp", type=int, default=2,
                        help="processes to spawn = tensor-parallel size (under torchrun: the world size, "
                             "this flag is ignored); the context-parallel part uses the same ranks")
    parser.add_argument("--steps", type=int, default=4, help="training steps run side by side with transformers")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pmz-demo-") as tmp:
        directory = Path(tmp) / "tiny-qwen2"
        if "RANK" in os.environ:  # under torchrun: rank 0 writes, everyone waits
            dist.init_process_group("gloo")
            shared = [str(directory)]
            dist.broadcast_object_list(shared, src=0)
            if dist.get_rank() == 0:
                write_tiny_qwen2(Path(shared[0]))
            dist.barrier()
            run(shared[0], dist.get_world_size(), args.steps)
            dist.barrier()
            dist.destroy_process_group()
            return
        print("[demo] writing a tiny random Qwen2 (4 layers, hidden 128) with transformers' save_pretrained ...",
              flush=True)
        write_tiny_qwen2(directory)
        print(f"[demo] starting {args.tp} gloo processes (each imports torch and transformers: ~10-20 s) ...",
              flush=True)
        run_distributed(args.tp, run, str(directory), args.tp, args.steps)


if __name__ == "__main__":
    main()
