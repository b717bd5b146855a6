"""Qwen3-VL-MoE weight map: Qwen3-MoE's decoder table (``moe_decoder_weight_map``: q/k norms, router
``mlp.gate.weight``, experts stacked into ``mlp.experts.w13_weight`` / ``w2_weight`` and split over EP,
the dense MLP on ``mlp_only_layers`` and off-step layers) under ``model.language_model.``, plus Qwen3-VL's
vision tower under ``model.visual.`` (``models/common/vision/qwen3.py``) and ``lm_head.weight`` (absent
when tied).

Experts: the map names them per expert (``mlp.experts.{e}.gate_proj.weight`` ...: the names the converters
and the exports use for every MoE model) and declares them stored fused (``fused_experts``): transformers 5.24
holds, saves and reads them only fused per layer, ``mlp.experts.gate_up_proj [E, 2 * moe_intermediate_size,
hidden]`` (gate rows, then up rows, per expert) and ``mlp.experts.down_proj [E, hidden, moe_intermediate_size]``
(per-expert names on disk would be unexpected keys to it, its experts left random). Readers take those through
``models/common/hf_files.per_expert_views`` (each expert's gate, up and down a byte range of the fused tensor),
writers (``save_pretrained``, ``pmz convert --to hf``) store them through ``hf_files.fused_expert_layout``: the
one rule for fused experts. The original Qwen3-VL-MoE releases store the same tensors transposed (``[E, hidden,
2F]``, ``[E, F, hidden]``; transformers transposes a tensor whose shape is not its own): read too, as strided
per-expert views (``per_expert_views`` says how the shapes decide it).
"""

from __future__ import annotations

import dataclasses

from models.common.config import ModelConfig
from models.common.vision.qwen3 import qwen3_vision_entries
from models.common.weight_map import WeightMap, moe_decoder_weight_map
from models.qwen3_vl.weights import TEXT_HF_PREFIX, counted_blocks

__all__ = ["TEXT_HF_PREFIX", "counted_blocks", "weight_map"]


def weight_map(cfg: ModelConfig, padded_vocab_size: int) -> WeightMap:
    assert cfg.vision is not None and cfg.moe is not None, f"{cfg.architecture} needs cfg.vision and cfg.moe"
    text = moe_decoder_weight_map(cfg, padded_vocab_size, hf_prefix=TEXT_HF_PREFIX, hf_lm_head="lm_head.weight")
    return dataclasses.replace(text, first_entries=text.first_entries + qwen3_vision_entries(cfg.vision),
                               fused_experts=True)
