"""What vLLM 0.32 needs of a Qwen3-VL checkpoint beyond the weight map (plain data, no torch), read by
``vllm_format.check_layout``.

vLLM's ``Qwen3VLForConditionalGeneration`` (``vllm/model_executor/models/qwen3_vl.py``) holds the same tensors
under the same names as our weight map, once its ``hf_to_vllm_mapper`` is applied (``model.visual.`` ->
``visual.``, ``model.language_model.`` -> ``language_model.model.``, ``lm_head.`` -> ``language_model.lm_head.``;
``vllm_format.vllm_name``): the text model is vLLM's ``Qwen3ForCausalLM`` (``qkv_proj``, ``gate_up_proj``,
q/k norms, no ``o_proj`` bias: ``vllm_format.NO_O_PROJ_BIAS``), tied by the top-level ``tie_word_embeddings``
(``VllmConfig.with_hf_config`` copies it into the text config). The tower (``Qwen3_VisionTransformer``, default
``mm_encoder_tp_mode="weights"``) is built whole on every pipeline stage and split over the same TP ranks:
``attn.qkv`` is Qwen2.5-VL's ``QKVParallelLinear`` (rank r holds ``[q_r | k_r | v_r]``: our ``Fused(3)`` as it
is, so Qwen3-VL is not in ``CONTIGUOUS_VISION_QKV``), ``attn.proj`` and every ``linear_fc2`` row-parallel (biases
whole), every ``linear_fc1`` (block MLP, merger, each DeepStack merger) column-parallel, the norms,
``patch_embed.proj`` (weight and bias) and ``pos_embed.weight`` (an ``nn.Embedding``) whole.

One constraint is vLLM's alone: with pipeline stages, every stage but the first must start at or after decoder
layer ``len(deepstack_visual_indexes)``: the DeepStack features are added on the first stage only, and the
``__init__`` of ``qwen3_vl.py``'s and ``qwen3_vl_moe.py``'s ``...ForConditionalGeneration`` asserts
``language_model.model.start_layer >= len(deepstack_visual_indexes)`` on every stage but the first; this
``deepstack_stage_problems`` checks. Qwen3-VL-MoE's text model (vLLM's Qwen3-MoE) builds the embedding, the final
norm and the LM head on every stage; ``vllm_stages`` says so and ``vllm_format.stage_tensors`` lists them there.
"""

from __future__ import annotations

from typing import Sequence

from models.common.config import ModelConfig


def deepstack_stage_problems(cfg: ModelConfig, pp: int, stages: Sequence[range]) -> list[str]:
    """vLLM's refusal of a pipeline split whose later stages start inside the DeepStack layers (``stages``: each
    vLLM stage's layers, ``vllm_format.pp_layer_ranges``); [] for other models and for a split it takes."""
    count = getattr(cfg.vision, "deepstack_count", 0)
    if pp < 2 or not count:
        return []
    early = [p for p, layers in enumerate(stages) if p > 0 and layers.start < count]
    if not early:
        return []
    return [f"pipeline stage {early[0]} starts at layer {stages[early[0]].start}, inside the {count} DeepStack "
            f"layers (vision_config.deepstack_visual_indexes): vLLM's {cfg.architecture} adds their features on the "
            f"first stage only and needs every later stage to start at layer {count} or after"]
