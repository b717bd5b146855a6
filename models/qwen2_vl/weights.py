"""Qwen2-VL weight map: the Qwen2 decoder table plus the vision tower (LayerNorm blocks, ``fc1``/``fc2``
MLP), declared once for the family in ``models/common/vision/weights.py`` (names, shapes, TP rules)."""

from __future__ import annotations

from models.common.vision.weights import HF_KEY_ALIASES, counted_blocks, vision_entries, weight_map

__all__ = ["HF_KEY_ALIASES", "counted_blocks", "vision_entries", "weight_map"]
