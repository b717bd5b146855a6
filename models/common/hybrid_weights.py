"""The weight map of the Gated DeltaNet hybrids (plain data, no torch): per-layer templates chosen by
``layer_types``, with the shard rule of every HF tensor (``parallel/sharding.py``).

Internal names are vLLM's (``vllm/model_executor/models/qwen3_5.py``), HF-like with vLLM's packing:

  linear layer i, ``model.layers.{i}.linear_attn.``
    ``in_proj_qkvz.weight``  ``[q_r | k_r | v_r | z_r]``  from ``in_proj_qkv`` (rule ``Blocks``: its q,
                            k, v blocks each split over TP) and ``in_proj_z`` (``Split(0)``)
    ``in_proj_ba.weight``    ``[b_r | a_r]``              from ``in_proj_b``, ``in_proj_a`` (``Split(0)``)
    ``conv1d.weight``        ``[q_r | k_r | v_r]`` channels (``Blocks``), ``[C/tp, 1, K]``
    ``A_log``, ``dt_bias``   this rank's value heads (``Split(0)``)
    ``norm.weight``          the gated RMSNorm ``[dv]``, whole on every rank
    ``out_proj.weight``      row-parallel (``Split(1)``)
  full-attention layer i, ``model.layers.{i}.self_attn.``
    ``qkv_proj.weight``      ``[q_r | k_r | v_r]``, q_proj's ``2 * heads * head_dim`` rows (each head's
                            query then its output gate) split by heads, k/v by ``KVHeads``
    ``o_proj.weight``, ``q_norm.weight``, ``k_norm.weight`` as Qwen3's
  every layer: the dense MLP and the two layer norms (vLLM's names, as the dense decoder's map); on the
  sparse layers of a mixture-of-experts config (Qwen3.5-MoE, Qwen3-Next) the sparse MLP's entries of
  ``moe_decoder_weight_map`` instead (router, per-expert ``mlp.experts.{e}.*`` as transformers writes
  them, shared expert and its gate).

Qwen3-Next (``interleaved=True``) stores the linear projections fused and interleaved per key-head group:
``in_proj_qkvz`` ``[per group g: q_g | k_g | v_g | z_g]`` (v_g, z_g: the group's Hv/Hk value heads) and
``in_proj_ba`` ``[per group: b_g | a_g]``; rule ``Groups`` gives each TP rank its run of groups
de-interleaved into the same ``[q_r | k_r | v_r | z_r]`` / ``[b_r | a_r]`` packing, so the model is the same.

Splitting heads contiguously keeps each value head with its key head when tp divides the key
heads (``ParallelConfig.validate`` refuses other tp). The layers' Megatron names are not declared yet (no
converter reads this map).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.common.hybrid_config import HybridModelConfig
from models.common.weight_map import GATE_UP_STACKED, VOCAB_PADDED, WeightEntry, WeightMap, moe_decoder_weight_map
from parallel.sharding import Blocks, Groups, KVHeads, Replicated, Split, Vocab


@dataclass(frozen=True)
class HybridWeightMap(WeightMap):
    """``layer_entries``: the full-attention layers' templates (``moe_layer_entries`` on the sparse layers
    ``moe_layers``); ``linear_layer_entries`` / ``linear_moe_layer_entries`` replace them for the layers in
    ``linear_layers``."""

    linear_layer_entries: tuple[WeightEntry, ...] = ()
    linear_layers: frozenset[int] = frozenset()
    linear_moe_layer_entries: tuple[WeightEntry, ...] = ()

    def layer_templates(self, layer: int) -> tuple[WeightEntry, ...]:
        if layer in self.linear_layers:
            return self.linear_moe_layer_entries if layer in self.moe_layers else self.linear_layer_entries
        return super().layer_templates(layer)


def hybrid_decoder_weight_map(cfg: HybridModelConfig, padded_vocab_size: int, *, hf_prefix: str = "model.",
                              hf_lm_head: str = "lm_head.weight", interleaved: bool = False) -> HybridWeightMap:
    """The map of a Gated DeltaNet hybrid whose decoder sits under ``hf_prefix``: dense MLPs (Qwen3.5) or,
    with ``cfg.moe``, sparse ones on ``cfg.sparse_layers()``; ``interleaved``: Qwen3-Next's fused
    linear projections (module doc)."""
    col, row, rep = Split(0), Split(1), Replicated()
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    layer = f"{hf_prefix}layers.{{i}}."
    param = "model.layers.{i}."

    def entry(name, hf_parts, rules, shapes):
        return WeightEntry(param + name, tuple(layer + p for p in hf_parts), rules, shapes=shapes)

    dense_mlp = (
        WeightEntry(param + "mlp.gate_up_proj.weight", (layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"),
                    (col, col), None, GATE_UP_STACKED, shapes=((inter, h), (inter, h))),
        entry("mlp.down_proj.weight", ("mlp.down_proj.weight",), (row,), ((h, inter),)),
    )
    norms = (
        entry("input_layernorm.weight", ("input_layernorm.weight",), (rep,), ((h,),)),
        entry("post_attention_layernorm.weight", ("post_attention_layernorm.weight",), (rep,), ((h,),)),
    )
    common = dense_mlp + norms
    sparse_mlp: tuple[WeightEntry, ...] = ()
    if cfg.moe is not None:
        sparse_mlp = tuple(e for e in moe_decoder_weight_map(cfg, padded_vocab_size, hf_prefix=hf_prefix,
                                                             hf_lm_head=hf_lm_head).moe_layer_entries
                           if ".mlp." in e.param)
    kv = KVHeads(hd, cfg.num_key_value_heads)
    q_rows = (2 if cfg.attn_output_gate else 1) * cfg.num_attention_heads * hd
    full = (
        entry("self_attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                            "self_attn.v_proj.weight"), (col, kv, kv),
              ((q_rows, h), (cfg.num_key_value_heads * hd, h), (cfg.num_key_value_heads * hd, h))),
        entry("self_attn.o_proj.weight", ("self_attn.o_proj.weight",), (row,), ((h, cfg.num_attention_heads * hd),)),
        entry("self_attn.q_norm.weight", ("self_attn.q_norm.weight",), (rep,), ((hd,),)),
        entry("self_attn.k_norm.weight", ("self_attn.k_norm.weight",), (rep,), ((hd,),)),
    )
    kd, vd, hv = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
    qkv = Blocks((kd, kd, vd))
    lin = "linear_attn."
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    rep_v = hv // max(hk, 1)  # value heads per key-head group
    if interleaved:
        projections = (
            entry(lin + "in_proj_qkvz.weight", (lin + "in_proj_qkvz.weight",),
                  (Groups((dk, dk, rep_v * dv, rep_v * dv), hk),), ((2 * kd + 2 * vd, h),)),
            entry(lin + "in_proj_ba.weight", (lin + "in_proj_ba.weight",), (Groups((rep_v, rep_v), hk),),
                  ((2 * hv, h),)),
        )
    else:
        projections = (
            entry(lin + "in_proj_qkvz.weight", (lin + "in_proj_qkv.weight", lin + "in_proj_z.weight"), (qkv, col),
                  ((2 * kd + vd, h), (vd, h))),
            entry(lin + "in_proj_ba.weight", (lin + "in_proj_b.weight", lin + "in_proj_a.weight"), (col, col),
                  ((hv, h), (hv, h))),
        )
    linear = projections + (
        entry(lin + "conv1d.weight", (lin + "conv1d.weight",), (qkv,), ((2 * kd + vd, 1, cfg.linear_conv_kernel_dim),)),
        entry(lin + "A_log", (lin + "A_log",), (col,), ((hv,),)),
        entry(lin + "dt_bias", (lin + "dt_bias",), (col,), ((hv,),)),
        entry(lin + "norm.weight", (lin + "norm.weight",), (rep,), ((cfg.linear_value_head_dim,),)),
        entry(lin + "out_proj.weight", (lin + "out_proj.weight",), (row,), ((h, vd),)),
    )
    vocab = Vocab(cfg.vocab_size, padded_vocab_size)
    first = (WeightEntry("model.embed_tokens.weight", (hf_prefix + "embed_tokens.weight",), (vocab,),
                         "embedding.word_embeddings.weight", VOCAB_PADDED, shapes=((cfg.vocab_size, h),)),)
    last = [WeightEntry("model.norm.weight", (hf_prefix + "norm.weight",), (rep,), "decoder.final_layernorm.weight",
                        shapes=((h,),))]
    if not cfg.tie_word_embeddings:
        last.append(WeightEntry("lm_head.weight", (hf_lm_head,), (vocab,), "output_layer.weight", VOCAB_PADDED,
                                shapes=((cfg.vocab_size, h),)))
    return HybridWeightMap(full + common, first, tuple(last), full + sparse_mlp + norms, cfg.sparse_layers(),
                           linear_layer_entries=linear + common, linear_layers=cfg.linear_layers(),
                           linear_moe_layer_entries=linear + sparse_mlp + norms)
