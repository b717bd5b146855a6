"""Rank bodies for the live-export tests: train next to transformers, then export and compare."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import ParallelConfig
from tests.cases import build, load_hf
from tests.workers_pipeline import batch


def _parameter_of(hf_name: str) -> str:
    """The packed parameter an HF tensor belongs to (q/k/v and gate/up are packed together)."""
    for part, packed in ((".q_proj.", ".qkv."), (".k_proj.", ".qkv."), (".v_proj.", ".qkv."),
                         (".gate_proj.", ".gate_up."), (".up_proj.", ".gate_up.")):
        hf_name = hf_name.replace(part, packed)
    return hf_name


def export_case(case: str, path: str, kwargs: dict, bucket_bytes: int, steps: int = 2, lr: float = 0.5,
                out_dir: str | None = None) -> list[tuple]:
    config = ParallelConfig(**kwargs)
    model = build(case, path, config)
    hf = load_hf(path)
    groups = model.groups
    ids, mask, labels = batch(hf.config.vocab_size)
    share = slice(groups.dp_rank * 4 // groups.dp_size, (groups.dp_rank + 1) * 4 // groups.dp_size)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(hf.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        model.forward_backward(ids[share], labels[share], attention_mask=mask[share], num_microbatches=2)
        hf(ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        ref_opt.step()
    tag = (case, config.describe(), bucket_bytes)
    buckets = list(model.iter_export("hf", bucket_bytes=bucket_bytes))
    exported = {name: t for b in buckets for name, t in b.tensors()}
    ref = hf.state_dict()
    expected = set(ref) - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set())
    # a bucket over the bound must hold a single parameter's tensors (q/k/v or gate/up travel together)
    oversize = [b for b in buckets if b.nbytes > bucket_bytes and len({_parameter_of(m.name) for m in b.metas}) > 1]
    names_in_order = [m.name for b in buckets for m in b.metas]
    checksum = torch.stack([t.double().sum() for t in exported.values()]).sum()
    checksums = [torch.zeros_like(checksum) for _ in range(dist.get_world_size())]
    dist.all_gather(checksums, checksum)
    bf16 = {name: t for b in model.iter_export("hf", bucket_bytes=bucket_bytes, dtype=torch.bfloat16)
            for name, t in b.tensors()}
    records = save_checks(model, tag, out_dir, bucket_bytes) if out_dir else []
    names_mismatch = len(set(exported) ^ expected) + len(names_in_order) - len(set(names_in_order))
    return records + [(*tag, "names_mismatch", float(names_mismatch)),
            (*tag, "vs_transformers", max((exported[n] - ref[n]).abs().max().item() for n in expected & set(exported))),
            (*tag, "oversize_buckets", float(len(oversize))),
            (*tag, "buckets", float(len(buckets))),
            (*tag, "ranks_differ", float(len({c.item() for c in checksums}) - 1)),
            (*tag, "bf16_not_cast",
             float(sum(not torch.equal(bf16[n], exported[n].to(torch.bfloat16)) for n in exported))),
            (*tag, "bf16_dtype", float(any(t.dtype != torch.bfloat16 for t in bf16.values())))]


def save_checks(model, tag, out_dir: str, bucket_bytes: int) -> list[tuple]:
    """``save_pretrained`` (small shards) loads in transformers with our logits; its files hold exactly
    the exported buckets' tensors, bitwise; a bf16 save stores bf16."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model.save_pretrained(out_dir, max_shard_size=bucket_bytes)
    model.save_pretrained(out_dir + "-bf16", dtype=torch.bfloat16)
    files = sorted(Path(out_dir).glob("*.safetensors"))
    on_disk = {k: v for f in files for k, v in load_file(str(f)).items()}
    exported = {name: t for b in model.iter_export("hf", bucket_bytes=bucket_bytes) for name, t in b.tensors()}
    bf16 = {k: v for f in Path(out_dir + "-bf16").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    bf16_config = json.loads((Path(out_dir + "-bf16") / "config.json").read_text())
    bf16_loaded = AutoModelForCausalLM.from_pretrained(out_dir + "-bf16", dtype="auto")
    loaded = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    ids = torch.randint(0, loaded.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_logits = loaded(ids).logits
        ours = model.forward_backward(ids, ids, forward_only=True)  # 1f1b at pp=2 raises its count to 2
        ref_lp = torch.zeros_like(ours)
        ref_lp[:, 1:] = torch.log_softmax(ref_logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return [(*tag, "saved_files", float(len(files))),
            (*tag, "saved_vs_exported_not_bitwise",
             float(set(on_disk) != set(exported) or any(not torch.equal(on_disk[k], exported[k]) for k in exported))),
            (*tag, "saved_logprobs_vs_ours", (ours - ref_lp).abs().max().item()),
            (*tag, "bf16_saved_not_cast", float(any(not torch.equal(bf16[k], exported[k].to(torch.bfloat16))
                                                    for k in exported))),
            (*tag, "bf16_saved_config_wrong", float(bf16_config.get("dtype") != "bfloat16"
                                                    or bf16_loaded.dtype != torch.bfloat16
                                                    or not bf16_config.get("architectures")))]


def export_suite(cases: list[tuple], out_root: str) -> list[tuple]:
    records = []
    for n, (case, path, kwargs, bucket_bytes) in enumerate(cases):
        records += export_case(case, path, kwargs, bucket_bytes, out_dir=f"{out_root}/save{n}")
    return records


def shm_case(case: str, path: str, kwargs: dict, bucket_bytes: int) -> list[tuple]:
    """``transport="shm"`` buckets (cloned as they come: each is valid until the next is requested)
    equal the collective transport's bitwise, for HF and for vLLM targets (padding-only vocabulary
    shards, replicated KV heads, a target TP above and below the training TP)."""
    from pathlib import Path

    model = build(case, path, ParallelConfig(**kwargs))
    tag = (case, ParallelConfig(**kwargs).describe())
    records = []
    for fmt, target_tp, target_rank in (("hf", None, None), ("vllm", 1, 0), ("vllm", 2, 1), ("vllm", 4, 2),
                                        ("vllm", 4, 3)):
        runs = []
        for transport in ("collective", "shm"):
            runs.append([(b.metas, b.buffer.clone()) for b in model.iter_export(
                fmt, bucket_bytes=bucket_bytes, target_tp=target_tp, target_rank=target_rank, transport=transport)])
        (a, b) = runs
        differ = len(a) != len(b) or any(ma != mb or not torch.equal(ta, tb) for (ma, ta), (mb, tb) in zip(a, b))
        records.append((*tag, f"{fmt}{target_tp or ''}.{target_rank or 0}", float(differ), float(len(a))))
    dist.barrier()
    leftovers = len(list(Path("/dev/shm").glob("pmz-*"))) if dist.get_rank() == 0 else 0
    return records + [(*tag, "shm_files_left", float(leftovers), 0.0)]


def shm_suite(cases: list[tuple]) -> list[tuple]:
    return [r for case in cases for r in shm_case(*case)]
