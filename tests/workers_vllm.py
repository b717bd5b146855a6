"""Rank bodies for the vLLM tests: train a parallel model, then write everything vLLM is checked on.

Per case (on every rank of a gloo job): two SGD steps next to transformers, then
  hf/                          save_pretrained (the HF weights vLLM's own loaders are run on)
  export-tp{N}.rank{r}.safetensors   iter_export("vllm", target_tp=N, target_rank=r), written by rank 0
  sharded-tp{N}[-pp{M}]/       save_vllm_sharded_state(tp=N[, pp=M])
  ours.json                    our prompt log-probs (forward_only) and transformers' trained-weight drift
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from parallel import ParallelConfig
from tests.cases import build, load_hf
from tests.workers_pipeline import batch

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 7, 300, 12, 5]]


def prompt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """PROMPTS right-padded into one batch, with its attention mask."""
    width = max(map(len, PROMPTS))
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, :len(p)] = torch.tensor(p)
        mask[i, :len(p)] = 1
    return ids, mask


def write_vllm_exports(model, root: Path, tps) -> None:
    """``export-tp{N}.rank{r}.safetensors``: ``iter_export("vllm", target_tp=N, target_rank=r)`` for every
    N in ``tps`` and every r (collective; rank 0 writes)."""
    from safetensors.torch import save_file

    for n in tps:
        for r in range(n):
            chunks = model.iter_export("vllm", target_tp=n, target_rank=r, bucket_bytes=20000)
            tensors = {name: t.clone() for b in chunks for name, t in b.tensors()}
            if dist.get_rank() == 0:
                save_file(tensors, str(root / f"export-tp{n}.rank{r}.safetensors"))


def vllm_case(case: str, path: str, kwargs: dict, out: str, export_tps: list[int], sharded_tps: list[int]) -> list:

    model = build(case, path, ParallelConfig(**kwargs))
    hf = load_hf(path)
    ids, mask, labels = batch(hf.config.vocab_size)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(hf.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2)
        hf(ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        ref_opt.step()
    root = Path(out)
    model.save_pretrained(root / "hf")
    rank = dist.get_rank()
    write_vllm_exports(model, root, export_tps)
    for n in sharded_tps:  # N (pp 1) or (N, pp)
        n, pp = n if isinstance(n, (tuple, list)) else (n, 1)
        name = f"sharded-tp{n}" + (f"-pp{pp}" if pp > 1 else "")
        model.save_vllm_sharded_state(root / name, tp=n, pp=pp, max_shard_size=100_000)
    ids, mask = prompt_batch()
    lp = model.forward_backward(ids, ids, attention_mask=mask, forward_only=True)
    ours = [lp[i, :len(p)].tolist() for i, p in enumerate(PROMPTS)]
    if rank == 0:
        (root / "ours.json").write_text(json.dumps({"logprobs": ours}))
    return [(case, rank)]


def lora_case(case: str, path: str, kwargs: dict, out: str, lora: dict) -> list:
    """LoRA on a TP/PP model, two SGD steps on the adapter only, saved as a peft adapter directory."""
    from peft import LoraConfig

    model = build(case, path, ParallelConfig(**kwargs), lora=LoraConfig(**lora))
    ids, mask, labels = batch(model.config.vocab_size)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=2.0)
    for _ in range(2):
        opt.zero_grad()
        model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2)
        opt.step()
    model.save_lora_adapter(Path(out) / "adapter")
    return [(case, dist.get_rank())]


def vllm_suite(cases: list[tuple], lora_cases: list[tuple] = ()) -> list:
    return [r for case in cases for r in vllm_case(*case)] + [r for case in lora_cases for r in lora_case(*case)]
