"""Writing Megatron-Bridge's checkpoint layout (``pmz convert --to megatron-bridge``): the text models Bridge
0.6.2 has bridges for (Llama, Qwen2, Qwen3, Qwen3-MoE; the Gated DeltaNet hybrids Qwen3.5, Qwen3.5-MoE and
Qwen3-Next, MTP block included; Qwen3.5 / Qwen3.5-MoE conditional-generation checkpoints as Bridge's
``Qwen3VLModel``, vision tower included) and the vision-language models.

What Megatron-Bridge 0.6.2 saves (``save_megatron_model``; checked against it, tests/bridge_oracle.py) and
what its ``load_megatron_model`` needs to load the model again:

  <root>/latest_checkpointed_iteration.txt   the iteration (Bridge's tracker)
  <root>/latest_train_state.pt               the training counters Bridge keeps beside it
  <root>/iter_XXXXXXX/                       megatron-core torch_dist: .metadata, __R_0.distcp,
                                             metadata.json, common.pt (checkpoint version, iteration,
                                             content metadata; no Megatron args), train_state.pt,
                                             run_config.yaml (the model provider Bridge instantiates)
  <root>/hf_config/                          ours: config.json and tokenizer files of the HF model
                                             (Bridge ignores it; pmz reads the model description there)

The tensors are megatron-core's torch_dist ones (a vision-language model: the text model's Megatron
names under ``language_model.`` and the vision tower's HF names, ``converters/layout/model.
bridge_vl_weight_map``), global (unsharded) at any TP/PP: the parallel layout is recorded in
run_config.yaml only. Layer norms are named as the Transformer-Engine spec Bridge builds names them
(``layout.stages.writer_norm_aliases``: a MoE layer's pre-MLP norm is ``pre_mlp_layernorm.weight``); a
hybrid's are megatron-core's per-layer keys (``layout.hybrid``: ``self_attention.in_proj.layer_norm_weight``,
``out_norm``, q/k ``layernorm`` as TE's modules, MTP under ``mtp.layers.0``).
Vocabulary rows are not padded (Bridge's providers default to ``should_pad_vocab=False``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from converters.formats.hf_config import write_config_dir
from converters.formats.megatron_args import HF_CONFIG_DIR, iteration_folder
from converters.formats.megatron_bridge import (
    RUN_CONFIG,
    TRAIN_STATE,
    check_bridge_qwen3_vl,
    check_bridge_text_model,
    run_config_text,
)
from converters.layout.hybrid import LayoutError, check_tower_tp
from converters.layout.model import is_qwen3_vl
from converters.layout.stages import MegatronLayout, check_target_stages, validate_target_layout
from converters.torch_path.megatron_dist import write_dist
from converters.torch_path.megatron_target import MegatronTarget
from converters.torch_path.reader import CheckpointReader


def plan_bridge_target(reader: CheckpointReader, *, tp: int, pp: int, vpp: int, dtype: torch.dtype,
                       first: int | None = None, last: int | None = None) -> MegatronTarget:
    """The Bridge target of a model, its layout validated (ParallelConfigError names the numbers); a text
    model must be one Bridge builds as it is (``check_bridge_text_model``: CheckpointError otherwise)."""
    cfg = reader.cfg
    if cfg.vision is None:
        check_bridge_text_model(cfg, reader.path, _mtp_layers(reader))
    elif is_qwen3_vl(cfg):
        check_bridge_qwen3_vl(cfg, reader.path)
        try:
            check_tower_tp(cfg, tp, reader.path)
        except LayoutError as exc:
            raise ValueError(str(exc)) from None
    check_target_stages(cfg.num_hidden_layers, pp, vpp, first, last)
    validate_target_layout(cfg, "megatron-bridge", tp=tp, pp=pp, vpp=vpp, first=first, last=last)
    layout = MegatronLayout(cfg.num_hidden_layers, pp, vpp, first, last, "target")
    iteration = reader.info.layout.get("iteration")
    iteration = iteration if isinstance(iteration, int) and not isinstance(iteration, bool) else 0
    return MegatronTarget(tp, pp, vpp, cfg.vocab_size, dtype, layout, None, iteration, bridge=True)


def _mtp_layers(reader: CheckpointReader) -> int:
    """The MTP layers the source holds (a Gated DeltaNet hybrid's ``mtp.*``; 0 otherwise)."""
    return getattr(reader.wmap, "mtp_layers", 0)


def train_state(iteration: int) -> dict[str, torch.Tensor]:
    """``train_state.pt`` as Megatron-Bridge writes it (counters of a run that has not trained here)."""
    zero = torch.tensor(0)
    return {"step": torch.tensor(iteration), "consumed_train_samples": zero.clone(),
            "skipped_train_samples": zero.clone(), "consumed_valid_samples": zero.clone(),
            "floating_point_operations_so_far": torch.tensor(0.0), "do_train": torch.tensor(False),
            "do_valid": torch.tensor(False), "do_test": torch.tensor(False)}


def write_bridge(reader: CheckpointReader, target: MegatronTarget, directory: str, *, workers: int,
                 progress: bool) -> None:
    """Megatron-Bridge's layout (module docstring) in ``directory``."""
    root = Path(directory)
    folder = iteration_folder(root, target.iteration)
    write_dist(reader, target, str(folder), workers=workers, progress=progress)  # Bridge's names, MTP included
    dtype = str(target.dtype).removeprefix("torch.")
    (folder / RUN_CONFIG).write_text(run_config_text(reader.hf_config, reader.cfg, tp=target.tp, pp=target.pp,
                                                     vpp=target.vpp, dtype=dtype, mtp_layers=_mtp_layers(reader)))
    torch.save(train_state(target.iteration), folder / TRAIN_STATE)
    torch.save(train_state(target.iteration), root / f"latest_{TRAIN_STATE}")
    hf_dir = root / HF_CONFIG_DIR
    hf_dir.mkdir()
    write_config_dir(reader.hf_config, hf_dir)  # with generation config, tokenizer files, chat template


__all__ = ["plan_bridge_target", "write_bridge"]
