"""LoRA adapters on disk, in peft's format: load one into a LoRA model, gather and save the model's.

The factors, their sharding and merging are ``models/common/blocks/lora.py``'s; files use peft's names
(``base_model.model.<hf module>.lora_A.weight`` in ``adapter_model.safetensors``) and config
(``adapter_config.json``), so peft loads what is saved here and vice versa.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from models.common.blocks.lora import LoraError
from models.common.export.saving import _StagedDirectory
from parallel.collectives import gather_shards
from parallel.fsdp import unshard
from parallel.grads import local_rows

ADAPTER_FILE = "adapter_model.safetensors"


def load_lora_adapter(model, directory) -> None:
    """Fill this rank's A/B slices from a peft adapter directory (every rank reads only its slices)."""
    from safetensors import safe_open

    from parallel.sharding import read_piece

    path = Path(directory) / ADAPTER_FILE
    if not path.is_file():
        raise LoraError(f"{path}: no adapter file")
    _check_adapter_config(model.lora_config, Path(directory))
    groups = model.groups
    params = dict(model.named_parameters())
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        missing = [k for t in model.lora_targets for k in (t.peft_a, t.peft_b) if k not in names]
        if missing:
            raise LoraError(f"{path}: {len(missing)} LoRA tensor(s) missing, e.g. {missing[0]} "
                            f"(the adapter's target modules or r differ from the model's LoraConfig?)")
        everything = {k for t in model.all_lora_targets for k in (t.peft_a, t.peft_b)}
        unexpected = sorted(names - everything)
        if unexpected:
            raise LoraError(f"{path}: {len(unexpected)} tensor(s) this LoRA model does not have, e.g. {unexpected[0]}")
        with torch.no_grad():
            for t in model.lora_targets:
                for key, rule, param, shape in ((t.peft_a, t.a_rule, t.a_param, t.a_shape),
                                                (t.peft_b, t.b_rule, t.b_param, t.b_shape)):
                    sl = f.get_slice(key)
                    if tuple(sl.get_shape()) != tuple(shape):
                        raise LoraError(f"{path}: {key} has shape {tuple(sl.get_shape())}, the model expects {shape}")
                    piece = read_piece(lambda idx, sl=sl: sl[idx], shape,
                                       rule.piece(shape, groups.tp_rank, groups.tp_size))
                    local, offset = local_rows(params[param])  # FSDP2: this rank's rows of the TP shard
                    local.copy_(piece[offset:offset + local.shape[0]].to(local.dtype))


def _check_adapter_config(config: Any, directory: Path) -> None:
    """The adapter's own config must give the same model (r, alpha, rsLoRA, targets) as the model's."""
    file = directory / "adapter_config.json"
    if not file.is_file():
        return
    import json

    saved = json.loads(file.read_text())
    ours = {"r": int(config.r), "lora_alpha": config.lora_alpha,
            "use_rslora": bool(getattr(config, "use_rslora", False)),
            "target_modules": sorted(config.target_modules) if not isinstance(config.target_modules, str)
            else config.target_modules}
    theirs = {"r": saved.get("r"), "lora_alpha": saved.get("lora_alpha"), "use_rslora": bool(saved.get("use_rslora")),
              "target_modules": sorted(saved["target_modules"]) if isinstance(saved.get("target_modules"), list)
              else saved.get("target_modules")}
    differ = [f"{k}: adapter {theirs[k]!r}, model {ours[k]!r}" for k in ours if ours[k] != theirs[k]]
    if differ:
        raise LoraError(f"{file}: the adapter was made with another LoraConfig ({'; '.join(differ)})")


def lora_state(model) -> dict[str, torch.Tensor]:
    """Collective over TP (and FSDP): the adapter's full tensors under peft's names, on every rank.
    With pp > 1 each stage returns its own layers' tensors."""
    groups = model.groups
    params = dict(model.named_parameters())
    out = {}
    for t in model.lora_targets:
        for key, rule, param in ((t.peft_a, t.a_rule, t.a_param), (t.peft_b, t.b_rule, t.b_param)):
            out[key] = rule.merge(gather_shards(unshard(params[param]).detach(), groups.tp_group))
    return out


def save_lora_adapter(model, directory) -> None:
    """Collective: a peft adapter directory (adapter_config.json with the real r / lora_alpha /
    target_modules, adapter_model.safetensors with peft's keys) written by global rank 0, atomic
    and failure-agreeing like ``save_pretrained`` (``saving._StagedDirectory``); missing parent
    directories are created."""
    import copy

    from models.common.hf_files import save_safetensors

    target = Path(directory)
    staged = _StagedDirectory(target, "save_lora_adapter")
    staged.run(target.parent.mkdir, parents=True, exist_ok=True)
    staged.check()
    state = lora_state(model)
    groups = model.groups
    if groups.pp_size > 1:  # every stage's layers to global rank 0
        parts = [None] * groups.pp_size
        dist.all_gather_object(parts, {k: v.cpu() for k, v in state.items()}, group=groups.pp_group)
        state = {k: v for part in parts for k, v in part.items()}
    staged.open()

    def finish(tmp: Path) -> None:
        config = copy.deepcopy(model.lora_config)
        if getattr(config, "base_model_name_or_path", None) is None and getattr(model, "hf_config", None) is not None:
            config.base_model_name_or_path = getattr(model.hf_config, "_name_or_path", None) or None
        config.save_pretrained(str(tmp))
        save_safetensors({k: v.contiguous() for k, v in sorted(state.items())}, tmp / ADAPTER_FILE,
                         metadata={"format": "pt"})  # the umask's mode (save_file leaves 0600)

    staged.commit(finish)
