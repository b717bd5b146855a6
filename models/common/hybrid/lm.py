"""The causal LM of the Gated DeltaNet hybrids (Qwen3.5): the shared ``ParallelCausalLM`` (inputs, loss,
fused head, export, training step) over the hybrid decoder (``blocks/hybrid_decoder.py``), with RoPE
tables of the partial rotary width. Export (HF, vLLM ``sharded_state``, FP8, live pushes) is the shared
model's: vLLM's map of these layers is ``models/common/vllm_format.vllm_map`` (checked against vLLM 0.32's
own loader and engine in tests/test_vllm_hybrid.py)."""

from __future__ import annotations

import torch

from models.common.blocks.hybrid_decoder import HybridDecoder
from models.common.blocks.rope import RotaryEmbedding
from models.common.causal_lm import ParallelCausalLM
from models.common.hybrid.config import HybridModelConfig
from models.common.weight_map import WeightMap
from parallel.groups import ParallelGroups


class HybridCausalLM(ParallelCausalLM):
    decoder_class = HybridDecoder

    def __init__(self, cfg: HybridModelConfig, groups: ParallelGroups, weight_map: WeightMap, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(cfg, groups, weight_map, dtype=dtype, device=device)
        # cos/sin [s, b, 1, rotary_dim]: the gated attention rotates the first rotary_dim channels of a head
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings)
        if device is not None:
            self.rotary.to(device)

