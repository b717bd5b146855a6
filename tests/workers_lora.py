"""Rank bodies for the LoRA tests: our parallel LoRA against peft on the same adapter."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from parallel import ParallelConfig
from tests.cases import build, load_hf

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(path: str, out: str, targets: list[str], r: int = 4, alpha: int = 16, rslora: bool = False) -> None:
    """A peft adapter with random A and B (peft's own init leaves B = 0, which would hide B's handling)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    peft_model = get_peft_model(load_hf(path), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                          lora_dropout=0.0, use_rslora=rslora))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    peft_model.save_pretrained(out)


def lora_case(case: str, path: str, adapter: str, out_root: str, kwargs: dict) -> list[tuple]:
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    from tests.workers_moe import per_expert_names  # MoE models: the experts under their on-disk names

    config = LoraConfig.from_pretrained(adapter)
    model = build(case, path, ParallelConfig(**kwargs), lora=config)
    model.load_lora_adapter(adapter)
    peft_model = PeftModel.from_pretrained(load_hf(path), adapter, is_trainable=True)
    tag = (case, ParallelConfig(**kwargs).describe(), bool(config.use_rslora))
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, peft_model.config.vocab_size, (2, 10), generator=gen)
    out = model(ids, labels=ids, gather_logits=True)
    ref = peft_model(input_ids=ids, labels=ids)
    records = [(*tag, "logits_vs_peft", (out.logits - ref.logits).abs().max().item())]
    out.loss.backward()
    ref.loss.backward()
    model.finalize_grads()
    base_grads = [n for n, p in model.named_parameters() if p.grad is not None and ".lora." not in n]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad and ".lora." not in n]

    grads = lora_state_of_grads(model)
    ref_grads = {n: p.grad for n, p in peft_model.named_parameters() if p.grad is not None}
    worst = max(((g - ref_grads[k.replace(".weight", ".default.weight")]).abs().max()
                 / ref_grads[k.replace(".weight", ".default.weight")].abs().max()).item() for k, g in grads.items())
    records += [(*tag, "lora_grads_vs_peft", worst),
                (*tag, "base_params_with_grad", float(len(base_grads) + len(trainable))),
                (*tag, "lora_grads_count_mismatch", float(len(grads) != len(ref_grads)))]

    # our adapter, saved, loads into peft and reproduces our logits; r and lora_alpha kept
    rank = dist.get_rank()
    saved = f"{out_root}/adapter"
    model.save_lora_adapter(saved)
    reloaded = PeftModel.from_pretrained(load_hf(path), saved)
    with torch.no_grad():
        again = reloaded(input_ids=ids).logits
    cfg = LoraConfig.from_pretrained(saved)
    records += [(*tag, "saved_adapter_logits", (again - out.logits).abs().max().item()),
                (*tag, "saved_config_differs", float((cfg.r, cfg.lora_alpha, set(cfg.target_modules), cfg.use_rslora)
                                                     != (config.r, config.lora_alpha, set(config.target_modules),
                                                         config.use_rslora)))]
    # merged weights equal peft's merge_and_unload
    merged_dir = f"{out_root}/merged"
    model.save_pretrained(merged_dir, merge_lora=True)
    merged = per_expert_names(AutoModelForCausalLM.from_pretrained(merged_dir).state_dict().items())
    ref_merged = per_expert_names(PeftModel.from_pretrained(load_hf(path), adapter).merge_and_unload()
                                  .state_dict().items())
    exported = {n: t for b in model.iter_export("hf", merge_lora=True) for n, t in b.tensors()}
    records += [(*tag, "merged_vs_peft", max((merged[k] - ref_merged[k]).abs().max().item() for k in exported)),
                (*tag, "merged_export_vs_saved", max((exported[k] - merged[k]).abs().max().item() for k in exported))]
    del rank
    return records


def lora_state_of_grads(model) -> dict:
    """The LoRA gradients gathered like the adapter (peft names)."""
    from models.common.export.lora_adapter import lora_state

    saved = {n: p.data for n, p in model.named_parameters() if ".lora." in n}
    try:
        for n, p in model.named_parameters():
            if ".lora." in n:
                p.data = p.grad
        return {k: v.clone() for k, v in lora_state(model).items()}
    finally:
        for n, p in model.named_parameters():
            if ".lora." in n:
                p.data = saved[n]


def lora_suite(cases: list[tuple]) -> list[tuple]:
    records = []
    for i, (case, path, adapter, kwargs) in enumerate(cases):
        records += lora_case(case, path, adapter, f"{cases_root(adapter)}/out{dist.get_world_size()}_{i}", kwargs)
    return records


def cases_root(adapter: str) -> str:
    return str(Path(adapter).parent)


def lora_training_suite(path: str, adapter: str, layouts: list[dict]) -> list[tuple]:
    """Two SGD steps of ``forward_backward`` on LoRA parameters only, next to peft on the whole batch:
    losses per step and the LoRA weights afterwards (gathered like the adapter), merged export too."""
    from peft import LoraConfig, PeftModel

    from models.common.export.lora_adapter import lora_state
    from tests.workers_pipeline import batch

    records = []
    for kwargs in layouts:
        config = LoraConfig.from_pretrained(adapter)
        model = build("qwen2_untied", path, ParallelConfig(**kwargs), lora=config)
        model.load_lora_adapter(adapter)
        peft_model = PeftModel.from_pretrained(load_hf(path), adapter, is_trainable=True)
        groups = model.groups
        tag = ("qwen2_untied", ParallelConfig(**kwargs).describe())
        ids, mask, labels = batch(peft_model.config.vocab_size)
        share = slice(groups.dp_rank * 4 // groups.dp_size, (groups.dp_rank + 1) * 4 // groups.dp_size)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        ref_opt = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.5)
        for step in range(2):
            opt.zero_grad()
            ref_opt.zero_grad()
            loss = model.forward_backward(ids[share], labels[share], attention_mask=mask[share], num_microbatches=2)
            ref = peft_model(input_ids=ids, attention_mask=mask, labels=labels)
            ref.loss.backward()
            records.append((*tag, f"loss_step{step}", abs(loss.item() - ref.loss.item())))
            opt.step()
            ref_opt.step()
        ours = lora_state(model)
        ref_params = {n.replace(".default", ""): p for n, p in peft_model.named_parameters() if "lora_" in n}
        records.append((*tag, "lora_after_steps", max((v - ref_params[k]).abs().max().item() for k, v in ours.items())))
        merged = {n: t for b in model.iter_export("hf", merge_lora=True) for n, t in b.tensors()}
        ref_merged = peft_model.merge_and_unload().state_dict()
        records.append((*tag, "merged_after_steps",
                        max((t - ref_merged[n]).abs().max().item() for n, t in merged.items())))
    return records


def tied_pipeline_lora(hf_config) -> float:
    """LoRA (embedding frozen) on a tied-embedding model split over 2 stages: one training step."""
    from peft import LoraConfig

    from models.qwen2 import build_parallel_model

    model = build_parallel_model(hf_config, ParallelConfig(pp=dist.get_world_size()), seed=2,
                                 lora=LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]))
    ids = torch.randint(0, hf_config.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    return model.forward_backward(ids, ids, num_microbatches=2).item()
