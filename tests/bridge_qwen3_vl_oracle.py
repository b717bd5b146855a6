"""Real Megatron-Bridge as a test oracle for Qwen3-VL / Qwen3-VL-MoE (``Qwen3VLForConditionalGeneration``,
``Qwen3VLMoeForConditionalGeneration``: Bridge's ``Qwen3VLBridge`` / ``Qwen3VLMoEBridge`` build megatron-core's
``Qwen3VLModel``), run under ``.venv-bridge``: ``python tests/bridge_qwen3_vl_oracle.py JOBS.json RESULT.json``.
Nothing of the project is imported here.

The jobs, results and CPU stand-ins are ``tests/bridge_gdn_oracle.py``'s (``write``, ``load`` with Bridge's loader or
megatron-core's strict ``dist_checkpointing.load``, ``export``) plus ``tests/bridge_qwen35_vl_oracle.py``'s tower
stand-ins (LayerNorm for TE's ``LayerNormLinear`` / ``TENorm``): Qwen3-VL's tower is Qwen3.5's plus the DeepStack
mergers, which ``Qwen3VLModel`` builds from the same merger spec, and its text GPT is built by
``get_gpt_layer_with_transformer_engine_spec`` from megatron-core's ``TESpecProvider``, which bridge_gdn_oracle
points at its torch stand-ins. Jobs name ``"mtp": false`` (these models have no MTP block).

Measured (megatron-bridge 0.6.2, megatron-core 0.19.2, transformers 5.12.1; tiny models of
tests/test_convert_qwen3_vl_megatron.py):
  * Files as every Bridge save (``iter_0000000/{.metadata, __0_0.distcp, metadata.json, run_config.yaml,
    train_state.pt}``, ``common_state/shard_0_1``); ``model._target_`` ``...qwen3_vl_provider.Qwen3VLModelProvider``
    / ``Qwen3VLMoEModelProvider``, ``hf_text_config`` (transformers' text config, the MoE one with both
    ``num_experts`` and ``num_local_experts``), ``vision_config`` (``Qwen3VLVisionConfig`` /
    ``Qwen3VLMoeVisionConfig``), ``head_dim``, ``mrope_section`` from the text config, ``hetereogenous_dist_checkpoint``
    false; MoE: ``moe_grouped_gemm`` true, ``moe_aux_loss_coeff`` 0.001 (not ``router_aux_loss_coef``),
    ``moe_router_load_balancing_type`` aux_loss, ``moe_router_pre_softmax`` false, ``mlp_only_layers`` recorded
    but every layer built sparse (the TE MoE spec for all layers).
  * Text under ``language_model.``, its layers **stacked** ``language_model.decoder.layers.<param>`` ``[L, ...]``
    (homogeneous TE layers): ``self_attention.linear_qkv.{weight, layer_norm_weight}``, ``linear_proj.weight``,
    ``q_layernorm`` / ``k_layernorm`` ``[L, head_dim]``, dense ``mlp.linear_fc1.{weight [L, 2F, H],
    layer_norm_weight}``, ``mlp.linear_fc2.weight``; MoE ``pre_mlp_layernorm.weight``, ``mlp.router.weight``
    ``[L, E, H]``, ``mlp.experts.experts.linear_fc1.weight`` ``[L, E, 2F, H]``, ``...linear_fc2.weight``
    ``[L, E, H, F]``; ``embedding.word_embeddings.weight`` unpadded, ``output_layer.weight`` when untied,
    ``decoder.final_layernorm.weight`` (and its ``_extra_state/shard_0_1``: TE's final norm, stood in by
    bridge_oracle._TENorm). ``_extra_state`` ``shard_{l}_{L}`` for linear_qkv, linear_proj,
    q_layernorm, k_layernorm and, dense, linear_fc1 / linear_fc2, MoE pre_mlp_layernorm; experts
    ``mlp.experts.experts.linear_fc{1,2}._extra_state/shard_{l}.{e}_{L}.{E}``.
  * Tower under ``vision_model.``: blocks stacked ``vision_model.decoder.layers.<param>`` ``[depth, ...]`` as
    Qwen3.5's, ``merger.{patch_norm,linear_fc1,linear_fc2}.{weight,bias}``, ``patch_embed.proj.{weight,bias}``,
    ``pos_embed.weight``, and the DeepStack mergers stacked too,
    ``vision_model.decoder.deepstack_merger_list.{patch_norm,linear_fc1,linear_fc2}.{weight,bias}``
    ``[len(deepstack_visual_indexes), ...]`` (patch_norm over ``hidden * merge^2``: the post-shuffle norm),
    merger k = HF ``model.visual.deepstack_merger_list.{k}`` (``norm`` -> ``patch_norm``), ``_extra_state``
    ``shard_{k}_{n}`` for each of its three modules (the blocks': their four linears).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import bridge_qwen35_vl_oracle as vl  # noqa: E402  (bridge_gdn_oracle's import guard, shims and stubs first)

if __name__ == "__main__":  # the checkpoint writer starts worker processes that import this file
    vl._install_vision()
    vl.gdn.main(sys.argv[1], sys.argv[2])
