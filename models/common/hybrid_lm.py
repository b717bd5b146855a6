"""The causal LM of the Gated DeltaNet hybrids (Qwen3.5): the shared ``ParallelCausalLM`` (inputs, loss,
fused head, export, training step) over the hybrid decoder (``blocks/hybrid_decoder.py``), with RoPE
tables of the partial rotary width.

vLLM's format is refused (``iter_export("vllm")``, ``save_vllm_sharded_state``):
vLLM 0.32 has ``qwen3_5.py``, but shards of these layers (``in_proj_qkvz`` split per q/k/v/z block at
the engine's TP, no attention scales on linear-attention layers) have not been checked against a
vLLM engine loading them, so nothing is written that might load wrong."""

from __future__ import annotations

import torch

from models.common.blocks.hybrid_decoder import HybridDecoder
from models.common.blocks.rope import RotaryEmbedding
from models.common.causal_lm import ParallelCausalLM
from models.common.export.buckets import ExportError
from models.common.hybrid_config import HybridModelConfig
from models.common.weight_map import WeightMap
from parallel.groups import ParallelGroups

VLLM_REFUSED = ("vLLM export of Gated DeltaNet hybrids (Qwen3.5) is not supported yet: its shards have not been "
                "checked against a vLLM engine (use iter_export('hf') / save_pretrained and load the HF checkpoint)")


class HybridCausalLM(ParallelCausalLM):
    decoder_class = HybridDecoder

    def __init__(self, cfg: HybridModelConfig, groups: ParallelGroups, weight_map: WeightMap, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(cfg, groups, weight_map, dtype=dtype, device=device)
        # cos/sin [s, b, 1, rotary_dim]: the gated attention rotates the first rotary_dim channels of a head
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings)
        if device is not None:
            self.rotary.to(device)

    def iter_export(self, format: str = "hf", **kwargs):
        if format == "vllm":
            raise ExportError(VLLM_REFUSED)
        return super().iter_export(format, **kwargs)

    def save_vllm_sharded_state(self, directory, **kwargs) -> None:
        raise ExportError(VLLM_REFUSED)
