"""Qwen3-VL-MoE: Qwen3-VL (``models/qwen3_vl/model.py``: the Qwen3-VL vision tower, DeepStack, interleaved
M-RoPE with videos frame by frame, the DeepStack tensor carried across pipeline stages) whose decoder
layers have Qwen3-MoE's sparse MLP (``models/common/blocks/moe.py``: router whole on every rank, experts
split over the EP group, each TP rank routing its own share of the tokens). The decoder builds the sparse
block wherever ``cfg.moe`` marks a layer sparse, so nothing here is new code but where the two models meet:

- transformers reads ``output_router_logits`` (the load-balancing loss, ``router_aux_loss_coef`` times it
  added to the loss) from ``text_config``, not from the top-level config where the text-only MoE models
  keep it; ``_wants_router_logits`` looks there too;
- ``save_pretrained`` writes each layer's experts fused (``mlp.experts.gate_up_proj [E, 2F, H]``, ``down_proj
  [E, H, F]``), the only form transformers 5.24 reads for this model: the weight map says so
  (``fused_experts``) and the shared writer stores them through ``hf_files.fused_expert_layout``;
- in ``forward_backward`` (any pp) the router statistics of the load-balancing loss travel with the hidden
  states after the DeepStack tensor (``DeepStackChunk`` with ``aux``: inputs ``(x, [deepstack], [carry])``),
  so a stage boundary inside the DeepStack-fed layers carries both.

``model(input_ids, ..., pixel_values=, image_grid_thw=, pixel_values_videos=, video_grid_thw=,
mm_token_type_ids=, cu_seqlens=, output_router_logits=)`` computes what transformers'
``Qwen3VLMoeForConditionalGeneration`` computes.
"""

from __future__ import annotations

from models.common.entry_point import entry_point
from models.qwen3_vl.model import ParallelQwen3VL
from models.qwen3_vl_moe.architecture import ARCHITECTURE

__all__ = ["ARCHITECTURE", "ParallelQwen3VLMoe", "build_parallel_model"]


class ParallelQwen3VLMoe(ParallelQwen3VL):
    """A tensor/sequence/context/pipeline/expert-parallel Qwen3-VL-MoE; build it with ``build_parallel_model``."""

    def _wants_router_logits(self, requested: bool | None) -> bool:
        if requested is None:  # transformers: ``config.text_config.output_router_logits``
            text = getattr(getattr(self, "hf_config", None), "text_config", None)
            requested = bool(getattr(text, "output_router_logits", False))
        return super()._wants_router_logits(requested)


# LoRA: on the language model's attention and dense MLPs as in Qwen3-MoE (routed experts and the router
# refused by name) and on the Qwen3-VL tower (models/common/blocks/lora.py)
build_parallel_model = entry_point(ARCHITECTURE, "Qwen3-VL-MoE", __name__, returns="ParallelQwen3VLMoe")
