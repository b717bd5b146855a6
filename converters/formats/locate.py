"""Where a checkpoint's tensors and model description are, for the layouts training frameworks write.

Torch-free (both conversion paths start here). ``locate_source`` turns what a user points ``pmz`` at into the
folder a reader opens plus the HF config directory that describes the model when the checkpoint
itself does not (no Megatron ``args``):

  Megatron-LM          <root>/latest_checkpointed_iteration.txt, iter_XXXXXXX/ (args in common.pt or
                       in the rank files)
  dist_checkpointing   a torch_dist folder written by ``dist_checkpointing.save(sharded_state_dict,
                       dir)`` alone: no args; described by ``--hf-config``
  verl                 <root>/latest_checkpointed_iteration.txt (the step), <root>/global_step_N/
                       {actor,critic}/ holding dist_ckpt/ (torch_dist: model, optimizer, rng_state;
                       no args), huggingface/ (HF config + tokenizer, maybe HF weights),
                       transformer_config.json, maybe adapter_checkpoint/. Newer verl nests them:
                       model/dist_ckpt/, model/huggingface/, optimizer/dist_ckpt/, extra/dist_ckpt/.
  vLLM sharded_state   config.json + model-rank-T-part-K.safetensors (model-pp-P-tp-T-part-K with PP)
  Megatron-Bridge      <root>/latest_checkpointed_iteration.txt (+ latest_train_state.pt),
                       iter_XXXXXXX/ torch_dist without args, run_config.yaml, train_state.pt,
                       tokenizer/, with ``also_save_hf_checkpoint`` an HF export in hf/; pmz's own
                       ``--to megatron-bridge`` adds <root>/hf_config/ (the HF config and tokenizer)

The format found is read by its validating reader (``converters/formats/__init__.CHECKPOINTS``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from converters.formats.vllm_sharded import is_vllm_dir
from models.common.errors import CheckpointError

VERL_ROLES = ("actor", "critic")
STEP_DIR = re.compile(r"^global_step_(\d+)$")


@dataclass
class SourceLocation:
    """What a reader opens (``path``, its ``format``), the HF config directory found beside it (None:
    the checkpoint describes itself, or ``--hf-config`` must), and what was recognized."""

    path: str
    format: str  # "hf", "megatron" (legacy torch), "megatron-dist" (torch_dist) or "vllm" (sharded_state)
    layout: str
    hf_config_dir: str | None = None
    config_origin: str | None = None  # how hf_config_dir was found, for `pmz inspect`
    notes: list[str] = field(default_factory=list)


def is_hf_dir(p: Path) -> bool:
    return (p / "config.json").is_file() and (any(p.glob("*.safetensors"))
                                              or (p / "model.safetensors.index.json").is_file())


def locate_source(path: Any, hf_config: str | None = None) -> SourceLocation:
    """The checkpoint ``path`` holds (see the module docstring); CheckpointError in one line otherwise.

    ``hf_config``: the model description the user gave (``--hf-config``); a Megatron-Bridge
    run_config.yaml is then not read for one."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a checkpoint directory")
    if is_vllm_dir(p):  # before is_hf_dir: config.json + *.safetensors too, but one TP rank's shards each
        return SourceLocation(str(p), "vllm", "vLLM sharded_state")
    if is_hf_dir(p):
        return SourceLocation(str(p), "hf", "HuggingFace")
    # the Megatron layouts' rules load only for a path that is neither HF nor vLLM
    from converters.formats.megatron_args import TRACKER, read_tracker, resolve_iteration_dir, tracker_step

    tracker = p / TRACKER
    if tracker.is_file():
        text = read_tracker(tracker)
        if text != "release":
            step = tracker_step(tracker, text)
            if not (p / f"iter_{step:07d}").is_dir() and (p / f"global_step_{step}").is_dir():
                return _verl_step(p / f"global_step_{step}", f"{tracker.name} names global_step_{step}")
            if not (p / f"iter_{step:07d}").is_dir() and any(p.glob("global_step_*")):
                raise CheckpointError(f"{tracker} names step {step}, but {p / f'global_step_{step}'} does not exist")
    elif STEP_DIR.match(p.name) or any((p / r).is_dir() and _is_verl_role(p / r) for r in VERL_ROLES):
        return _verl_step(p, None)
    if _is_verl_role(p):
        return _verl_role(p, None)
    it_dir = resolve_iteration_dir(p)
    if (it_dir / "metadata.json").is_file():
        return _dist_location(p, it_dir, hf_config)
    if any(it_dir.glob("mp_rank_*")):
        return SourceLocation(str(p), "megatron", "Megatron-LM legacy (torch)")
    if STEP_DIR.match(p.name):
        raise CheckpointError(f"{p}: no actor/ (verl checkpoints hold actor/ and critic/ here)")
    steps = sorted((int(m.group(1)), c.name) for c in p.iterdir() if (m := STEP_DIR.match(c.name)) and c.is_dir())
    if steps:
        raise CheckpointError(f"{p}: verl checkpoint root without {TRACKER}; point at a step's actor, e.g. "
                              f"{p / steps[-1][1] / 'actor'}")
    raise CheckpointError(f"{p}: not a recognized checkpoint (HF: config.json + *.safetensors; Megatron: "
                          f"latest_checkpointed_iteration.txt / iter_*/ with mp_rank_* or metadata.json; "
                          f"verl: global_step_N/actor/; vLLM: config.json + model-rank-T-part-K.safetensors)")


def _is_verl_role(p: Path) -> bool:
    return ((p / "dist_ckpt").is_dir() or (p / "model" / "dist_ckpt").is_dir()
            or (p / "model" / "huggingface").is_dir()
            or ((p / "huggingface").is_dir() and (p / "transformer_config.json").is_file()))


def _verl_step(step_dir: Path, via: str | None) -> SourceLocation:
    """``global_step_N/``: its actor (the policy, a causal LM). A critic is a value model (one output
    per token), which no HF causal-LM checkpoint holds, so it is never picked."""
    roles = [r for r in VERL_ROLES if (step_dir / r).is_dir()]
    if "actor" not in roles:
        found = f"only {', '.join(r + '/' for r in roles)}" if roles else "no actor/ or critic/"
        raise CheckpointError(f"{step_dir}: {found}; pmz converts the actor (a causal LM), and a verl critic is a "
                              f"value model")
    loc = _verl_role(step_dir / "actor", via)
    if "critic" in roles:
        loc.notes.append("critic/ beside it not converted (a value model)")
    return loc


def _verl_role(role: Path, via: str | None) -> SourceLocation:
    """``global_step_N/actor`` (or critic): the torch_dist model in dist_ckpt/ (model/dist_ckpt/ in the
    newer layout) described by huggingface/; HF weights in huggingface/ when dist_ckpt has no model."""
    nested = (role / "model").is_dir() and ((role / "model" / "dist_ckpt").is_dir()
                                            or (role / "model" / "huggingface").is_dir())
    base = role / "model" if nested else role
    dist, hf = base / "dist_ckpt", base / "huggingface"
    name = f"verl {role.name} ({role.parent.name}/{role.name}, {'model/' if nested else ''}dist_ckpt + huggingface)"
    notes = [via] if via else []
    for extra in ("adapter_checkpoint", "optimizer", "extra"):
        if (role / extra).is_dir() and (extra != "optimizer" or nested):
            notes.append(f"{extra}/ not read" + (" (LoRA adapters are not converted)"
                                                 if extra == "adapter_checkpoint" else ""))
    hf_config = str(hf) if (hf / "config.json").is_file() else None
    has_dist = (dist / "metadata.json").is_file()
    if is_hf_dir(hf) and (not has_dist or not dist_has_model(dist)):
        notes.append("model weights from huggingface/ (dist_ckpt holds no model)" if has_dist else
                     "model weights from huggingface/")
        return SourceLocation(str(hf), "hf", name, str(hf), f"verl {hf.relative_to(role.parent)}/ folder", notes)
    if not has_dist:
        raise CheckpointError(f"{role}: verl checkpoint without model weights: no {dist.relative_to(role)}/"
                              f"metadata.json and no safetensors in {hf.relative_to(role)}/")
    origin = f"verl {hf.relative_to(role.parent)}/ folder" if hf_config else None
    return SourceLocation(str(dist), "megatron-dist", name, hf_config, origin, notes)


def _dist_location(p: Path, it_dir: Path, hf_config: str | None) -> SourceLocation:
    """A torch_dist folder: Megatron-LM/bare dist_checkpointing, a verl dist_ckpt/ or a Bridge iter_*/."""
    if it_dir.name == "dist_ckpt":
        role = it_dir.parent.parent if it_dir.parent.name == "model" else it_dir.parent
        hf = it_dir.parent / "huggingface"
        if (hf / "config.json").is_file():
            return SourceLocation(str(p), "megatron-dist", f"verl {role.name} dist_ckpt", str(hf),
                                  "verl huggingface/ folder beside dist_ckpt/")
        return SourceLocation(str(p), "megatron-dist", "torch_dist (dist_ckpt/)")
    if (it_dir / "run_config.yaml").is_file():
        return _bridge_location(p, it_dir, hf_config)
    return SourceLocation(str(p), "megatron-dist", "Megatron torch_dist")


def _bridge_location(p: Path, it_dir: Path, hf_config: str | None) -> SourceLocation:
    """Megatron-Bridge ``iter_*/``: no Megatron args; the model is described by its HF export in hf/
    (``also_save_hf_checkpoint``) or by the local HF directory its run_config.yaml names
    (``converters/formats/megatron_bridge``: bounded, data only). With ``--hf-config`` given, a
    run_config.yaml that cannot be read only loses its note; without, it is an error naming it."""
    from converters.formats.megatron_args import HF_CONFIG_DIR, sidecar_config_dir
    from converters.formats.megatron_bridge import bridge_hf_model_id

    name = f"Megatron-Bridge ({it_dir.name}, run_config.yaml)"
    notes = []
    if (it_dir / "tokenizer").is_dir():
        notes.append("tokenizer/ present (companion files come from the HF config directory)")
    hf = it_dir / "hf"
    if (hf / "config.json").is_file():
        return SourceLocation(str(p), "megatron-dist", name, str(hf), "Megatron-Bridge hf/ export", notes)
    sidecar = sidecar_config_dir(str(it_dir))  # what pmz writes beside the iterations (--to megatron-bridge)
    if sidecar:
        return SourceLocation(str(p), "megatron-dist", name, sidecar, f"{HF_CONFIG_DIR}/ beside the iterations", notes)
    try:
        model_id = bridge_hf_model_id(it_dir / "run_config.yaml")
    except CheckpointError as exc:
        if not hf_config:
            raise
        notes.append(f"run_config.yaml not read ({exc})")
        return SourceLocation(str(p), "megatron-dist", name, None, None, notes)
    if model_id and (Path(model_id) / "config.json").is_file():
        return SourceLocation(str(p), "megatron-dist", name, model_id, "run_config.yaml model.hf_model_id", notes)
    if model_id:
        notes.append(f"run_config.yaml names hf_model_id={model_id} (not a local directory: pass --hf-config)")
    return SourceLocation(str(p), "megatron-dist", name, None, None, notes)


def dist_has_model(dist: Path) -> bool:
    """Whether a torch_dist folder's .metadata lists model tensors (verl saves only optimizer and RNG
    state there when the bridge writes the weights as HF)."""
    from converters.formats.pickles import read_pickle

    try:
        md = read_pickle(dist / ".metadata")
        keys = list(md.state_dict_metadata)
    except (CheckpointError, AttributeError, TypeError):
        return True  # let the reader name the problem
    return any(k.startswith(("embedding.", "decoder.", "output_layer.", "language_model.", "visual.")) for k in keys)


__all__ = ["SourceLocation", "locate_source", "is_hf_dir", "dist_has_model"]
