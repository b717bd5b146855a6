"""``pmz inspect``: what a checkpoint holds, from headers and metadata (tensor data is not read).

What it lists it has validated: the source's reader checks every file, header and tensor entry as a
conversion would before writing (a truncated rank file is an error naming it, exit 1), so a summary
means the checkpoint converts; tensor *values* are not read (``pmz verify`` compares them). An HF
directory in the block-wise FP8 format (``pmz convert --quantize fp8``) is described too, with a
``quantization`` line (``converters/torch_path/hf_fp8_reader``); it is not a conversion source."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from converters.formats.locate import SourceLocation, locate_source
from converters.torch_path import open_reader


def inspect_checkpoint(path: str | os.PathLike, *, vocab_size: int | None = None, hf_config: str | None = None) -> dict:
    """Format, layout recognized, where the model description came from, architecture, parallel layout,
    parameter count, dtype, bytes on disk, and the non-model entries a conversion skips."""
    location = locate_source(path, hf_config)
    reader = open_reader(path, vocab_size=vocab_size, hf_config=hf_config, fp8=True)
    reader.validate()  # every rank file and tensor entry, as a conversion checks them before writing
    shapes = reader.hf_shapes()
    params = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        params += n
    cfg = reader.cfg
    size = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
    layout = {k: v for k, v in reader.info.layout.items() if v is not None}
    info: dict[str, Any] = {
        "format": reader.info.format,
        "layout": _layout(reader, location, path),
        "model_description": _config_source(reader, location, hf_config),
        "architecture": reader.arch.name,
        "model": f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {_ffn(cfg)}, "
                 f"heads {cfg.num_attention_heads} (kv {cfg.num_key_value_heads}, head_dim {cfg.head_dim}), "
                 f"vocab {cfg.vocab_size}, {'tied' if cfg.tie_word_embeddings else 'untied'} embeddings",
        **_layer_mix(cfg),
        **_experts(cfg),
        "parallel_layout": ", ".join(f"{k}={v}" for k, v in layout.items()),
        "files": reader.info.files,
        "parameters": params,
        "dtype": (f"mixed: {reader.info.mixed.split(': pass --dtype')[0]} (a conversion needs --dtype)"
                  if getattr(reader.info, "mixed", None) else str(reader.info.dtype).replace("torch.", "")),
        **({"quantization": reader.describe(), "dtype": "float8_e4m3fn, float32 scales, " + " and ".join(
            reader.kept_dtypes) + " kept"} if hasattr(reader, "describe") else {}),
        "bytes": size,
        "checked": "every file's headers and metadata, every tensor's presence and shape (not the values: pmz verify)",
    }
    if reader.info.format in ("megatron", "megatron-dist"):
        from converters.engine import source_layout

        stages = source_layout(reader)
        for side in ("first", "last"):
            if stages[side] is not None:
                info["parallel_layout"] += f", {side} stage {stages[side]} layers"
    if reader.info.format == "megatron-dist" and getattr(reader, "args", None) is None:
        info["parallel_layout"] = ("saved with: unknown (no Megatron args; torch_dist tensors are global); "
                                   + info["parallel_layout"])
    skipped = [f"{k}: {v}" for k, v in (getattr(reader, "skipped", {}) or {}).items()]
    if skipped:
        skipped[-1] += " (bytes not read)"
    common = [k for k in getattr(reader, "common", {}) or {} if k not in ("args", "checkpoint_version", "iteration")]
    if common:
        skipped.append(f"common.pt: {', '.join(sorted(map(str, common)))} (ignored)")
    if skipped:
        info["skipped"] = "; ".join(skipped)
    if location.notes:
        info["notes"] = "; ".join(location.notes)
    return info


def _config_source(reader: Any, location: SourceLocation, hf_config: str | None) -> str:
    """Where the model's description (sizes, architecture) came from."""
    if reader.info.format in ("hf", "vllm"):
        return f"config.json in {location.path}"
    args = getattr(reader, "args", None)
    checked = " (checked against the Megatron args)" if args is not None else ""
    if hf_config:
        return f"--hf-config {hf_config}{checked}"
    if location.hf_config_dir:
        return f"{location.config_origin}: {location.hf_config_dir}{checked}"
    where = "common.pt" if reader.info.format == "megatron-dist" else "the rank files"
    from converters.formats.megatron_args import HF_CONFIG_DIR, resolve_iteration_dir

    it_dir = resolve_iteration_dir(Path(location.path))
    for root in (it_dir, it_dir.parent):
        if (root / HF_CONFIG_DIR / "config.json").is_file():
            return f"{HF_CONFIG_DIR}/ sidecar {root / HF_CONFIG_DIR} (checked against the Megatron args in {where})"
    return f"Megatron args in {where}"


def _layout(reader: Any, location: SourceLocation, path: str | os.PathLike) -> str:
    name = location.layout
    if name == "Megatron torch_dist" and getattr(reader, "args", None) is None:
        name = "torch_dist without Megatron args (dist_checkpointing.save alone?)"
    return name + (f" (tensors in {location.path})" if Path(location.path) != Path(path) else "")


def _ffn(cfg) -> str:
    """The MLP width of the dense layers; a model whose every layer is an MoE layer has none (its
    ``intermediate_size`` sizes nothing): the experts' width then."""
    moe = cfg.moe
    if moe is None:
        return f"ffn {cfg.intermediate_size}"
    dense = cfg.num_hidden_layers - len(cfg.sparse_layers())
    if dense == 0:
        return f"expert ffn {moe.moe_intermediate_size} (every layer MoE)"
    return f"ffn {cfg.intermediate_size} on {dense} dense layer{'s' if dense != 1 else ''}"


def _layer_mix(cfg) -> dict[str, str]:
    """A Gated DeltaNet hybrid's layer kinds (nothing for a model of attention layers only): how many
    of each, where the full-attention ones sit, and the linear layers' heads."""
    linear = sorted(cfg.linear_layers()) if hasattr(cfg, "linear_layers") else []
    if not linear:
        return {}
    full = [i for i in range(cfg.num_hidden_layers) if i not in set(linear)]
    return {"layers": f"{len(linear)} linear-attention (Gated DeltaNet: {cfg.linear_num_key_heads} key / "
                      f"{cfg.linear_num_value_heads} value heads, dims {cfg.linear_key_head_dim}/"
                      f"{cfg.linear_value_head_dim}) + {len(full)} full-attention (layers "
                      f"{', '.join(map(str, full))})"}


def _experts(cfg) -> dict[str, str]:
    """The mixture-of-experts line (nothing for dense models)."""
    moe = cfg.moe
    if moe is None:
        return {}
    sparse = sorted(cfg.sparse_layers())
    shared = f"shared expert {moe.shared_expert_intermediate_size}" if moe.shared_expert_intermediate_size \
        else "no shared expert"
    return {"experts": f"{moe.num_experts} x ffn {moe.moe_intermediate_size}, top-{moe.top_k} "
                       f"({'renormalised' if moe.norm_topk_prob else 'softmax over all, not renormalised'}), "
                       f"{shared}, on {len(sparse)} of {cfg.num_hidden_layers} layers"}
