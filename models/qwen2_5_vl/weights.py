"""Qwen2.5-VL weight map: the Qwen2 decoder table plus the vision tower (RMSNorm blocks without biases,
gated ``gate_proj``/``up_proj``/``down_proj`` MLP with biases, packed as ``mlp.gate_up_proj``), declared
once for the family in ``models/common/vision/weights.py`` (names, shapes, TP rules). On disk
transformers 5.23 writes the original release layout (``visual.*``, ``model.*``, ``lm_head.*``), as for
Qwen2-VL; its in-memory layout is read through ``HF_KEY_ALIASES``."""

from __future__ import annotations

from models.common.vision.weights import HF_KEY_ALIASES, counted_blocks, vision_entries, weight_map

__all__ = ["HF_KEY_ALIASES", "counted_blocks", "vision_entries", "weight_map"]
