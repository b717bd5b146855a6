"""The weight map of the Gated DeltaNet hybrids (plain data, no torch): per-layer templates chosen by
``layer_types``, with the shard rule of every HF tensor (``parallel/sharding.py``) and its megatron-core
name and layout (Megatron-Bridge 0.6.2's ``qwen35_bridge.py`` / ``qwen3_next_bridge.py`` names: the
Transformer-Engine spec of megatron-core's ``GatedDeltaNet``, the only one it builds).

Internal names are vLLM's (``vllm/model_executor/models/qwen3_5.py``), HF-like with vLLM's packing:

  linear layer i, ``model.layers.{i}.linear_attn.``           Megatron ``decoder.layers.{i}.self_attention.``
    ``in_proj_qkvz.weight``  ``[q_r | k_r | v_r | z_r]``  from ``in_proj_qkv`` (rule ``Blocks``: its q,
                            k, v blocks each split over TP) and ``in_proj_z`` (``Split(0)``)
    ``in_proj_ba.weight``    ``[b_r | a_r]``              from ``in_proj_b``, ``in_proj_a`` (``Split(0)``)
                            both in Megatron's one ``in_proj.weight`` (below)
    ``conv1d.weight``        ``[q_r | k_r | v_r]`` channels (``Blocks``), ``[C/tp, 1, K]``   ``conv1d.weight``
    ``A_log``, ``dt_bias``   this rank's value heads (``Split(0)``)                         same names
    ``norm.weight``          the gated RMSNorm ``[dv]``, whole on every rank              ``out_norm.weight`` - 1
    ``out_proj.weight``      row-parallel (``Split(1)``)                                  ``out_proj.weight``
    ``input_layernorm``                                                          ``in_proj.layer_norm_weight``
  full-attention layer i, ``model.layers.{i}.self_attn.``
    ``qkv_proj.weight``      ``[q_r | k_r | v_r]``, q_proj's ``2 * heads * head_dim`` rows (each head's
                            query then its output gate) split by heads, k/v by ``KVHeads``
                            -> ``linear_qkv.weight``, per query group ``[queries | gates | k | v]``
    ``o_proj``, ``q_norm``, ``k_norm`` -> ``linear_proj``, ``q_layernorm``, ``k_layernorm``
    ``input_layernorm``                                                        ``linear_qkv.layer_norm_weight``
  every layer: the dense MLP (``mlp.linear_fc1`` [gate; up], ``linear_fc2``, the post-attention norm as
  ``mlp.linear_fc1.layer_norm_weight``) or, on the sparse layers of a mixture-of-experts config (Qwen3.5-MoE,
  Qwen3-Next), the sparse MLP's entries of ``moe_decoder_weight_map`` (router, per-expert
  ``mlp.experts.{e}.*`` as transformers writes them, shared expert and its gate) with the norm as
  ``pre_mlp_layernorm.weight``.

Qwen3-Next (``interleaved=True``) stores the linear projections fused and interleaved per key-head group:
``in_proj_qkvz`` ``[per group g: q_g | k_g | v_g | z_g]`` (v_g, z_g: the group's Hv/Hk value heads) and
``in_proj_ba`` ``[per group: b_g | a_g]``; rule ``Groups`` gives each TP rank its run of groups
de-interleaved into the same ``[q_r | k_r | v_r | z_r]`` / ``[b_r | a_r]`` packing, so the model is the same.
Splitting heads contiguously keeps each value head with its key head when tp divides the key
heads (``ParallelConfig.validate`` refuses other tp).

Megatron's ``in_proj.weight`` holds both projections: its TP shard r is ``[q_r | k_r | v_r | z_r | b_r | a_r]``
(the model's two packed shards one after the other) and torch_dist stores it as six global tensors
``in_proj.weight.{query,key,value,z,beta,alpha}`` (``conv1d.weight.{query,key,value}`` likewise: layout
``PACKED``). The model keeps two parameters, so ``HybridWeightMap.for_conversion`` gives the converters the
map with the two entries merged into one (built from them, not declared again).

MTP (multi-token prediction; real checkpoints hold it, transformers' CausalLM classes do not load it):
``mtp.fc.weight`` [H, 2H] (column-parallel), ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
``mtp.norm`` and ``mtp.layers.{k}.*``, a full-attention decoder layer with the model's MLP (sparse for the
MoE models), <-> Megatron ``mtp.layers.0.eh_proj``, ``enorm``, ``hnorm``, ``final_layernorm`` and
``mtp.layers.{k}.mtp_model_layer.*`` (Bridge's ``_get_dense_mtp_mappings`` / ``_get_moe_mtp_mappings``).
The model never loads them; the conversion map carries them on the last pipeline stage when a checkpoint
holds them (``for_conversion(mtp_layers=1)``).

A conditional-generation checkpoint (``cfg.carried``: the vision tower, ``models/common/hybrid/vision.py``) is
Megatron-Bridge's ``Qwen3VLModel`` in Megatron: every text and MTP name above under ``language_model.`` and each
tower tensor one entry after the embedding (first pipeline stage, where Megatron builds pre-process modules),
named ``vision_model.*`` with its TP split as a rule on the Megatron tensor (``Split(0)`` column-parallel,
``Split(1)`` row-parallel, ``Replicated``; the model never loads the tower, so only the converters apply them)
and the ``qkv`` tensors in layout ``TOWER_QKV`` (per head ``[q_h; k_h; v_h]``, ``converters/layout/hybrid``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from models.common.hybrid.config import HybridModelConfig
from models.common.hybrid.vision import COLUMN, MEGATRON_TEXT, ROW, TOWER_QKV, tower_megatron
from models.common.weight_map import (
    GATE_UP_STACKED,
    MINUS_ONE,
    PACKED,
    PLAIN,
    QKV_GATED,
    VOCAB_PADDED,
    WeightEntry,
    WeightMap,
    moe_decoder_weight_map,
)
from parallel.sharding import Blocks, Groups, KVHeads, Replicated, Split, Vocab

# megatron-core's torch_dist key suffixes of the GDN tensors it splits (GatedDeltaNet.sharded_state_dict)
IN_PROJ_PARTS = ("query", "key", "value", "z", "beta", "alpha")
CONV_PARTS = ("query", "key", "value")
MTP_PREFIX = "mtp."  # HF names of the MTP block (model.* is the decoder)
MTP_LAYER_MEGATRON = "mtp.layers.{i}.mtp_model_layer."  # the MTP layer's decoder layer, in-memory / legacy name


@dataclass(frozen=True)
class HybridWeightMap(WeightMap):
    """``layer_entries``: the full-attention layers' templates (``moe_layer_entries`` on the sparse layers
    ``moe_layers``); ``linear_layer_entries`` / ``linear_moe_layer_entries`` replace them for the layers in
    ``linear_layers``.

    ``conversion_linear`` / ``conversion_linear_moe``: the linear layers' templates with the two projections
    merged into Megatron's one ``in_proj`` (``for_conversion``). ``mtp_layer_entries`` / ``mtp_head_entries``:
    the MTP block (templates ``{i}`` = MTP layer, and its fc and norms); ``mtp_layers``: how many MTP layers
    ``entries``/the converters carry (0 in the model's map, which never loads them). ``carried_entries``: the
    tensors of a conditional-generation checkpoint that the model does not hold (its vision tower,
    ``cfg.carried``), one entry each with its Megatron name (module doc), after the embedding in the converters' map."""

    linear_layer_entries: tuple[WeightEntry, ...] = ()
    linear_layers: frozenset[int] = frozenset()
    linear_moe_layer_entries: tuple[WeightEntry, ...] = ()
    conversion_linear: tuple[WeightEntry, ...] = ()
    conversion_linear_moe: tuple[WeightEntry, ...] = ()
    mtp_layer_entries: tuple[WeightEntry, ...] = ()
    mtp_head_entries: tuple[WeightEntry, ...] = ()
    mtp_layers: int = 0
    carried_entries: tuple[WeightEntry, ...] = ()

    def layer_templates(self, layer: int) -> tuple[WeightEntry, ...]:
        if layer in self.linear_layers:
            return self.linear_moe_layer_entries if layer in self.moe_layers else self.linear_layer_entries
        return super().layer_templates(layer)

    def mtp_entries(self) -> list[WeightEntry]:
        """The MTP block's entries (names formatted, experts expanded), in HF order: fc and norms, then each
        MTP layer; none when ``mtp_layers`` is 0."""
        if not self.mtp_layers:
            return []
        return list(self.mtp_head_entries) + [t.format(k) for k in range(self.mtp_layers)
                                              for t in self.mtp_layer_entries]

    def entries(self, layers, first: bool = True, last: bool = True) -> list[WeightEntry]:
        return super().entries(layers, first, last) + (self.mtp_entries() if last else [])

    def for_conversion(self, mtp_layers: int = 0) -> "HybridWeightMap":
        """The converters' map: Megatron's ``in_proj`` one entry, the MTP block carried when ``mtp_layers``."""
        first = self.first_entries  # the carried tensors after the embedding, once (a map may be re-derived)
        if self.carried_entries and first[-len(self.carried_entries):] != self.carried_entries:
            first = first + self.carried_entries
        return replace(self, linear_layer_entries=self.conversion_linear,
                       linear_moe_layer_entries=self.conversion_linear_moe, mtp_layers=mtp_layers,
                       first_entries=first)


def hybrid_decoder_weight_map(cfg: HybridModelConfig, padded_vocab_size: int, *, hf_prefix: str = "model.",
                              hf_lm_head: str = "lm_head.weight", interleaved: bool = False) -> HybridWeightMap:
    """The map of a Gated DeltaNet hybrid whose decoder sits under ``hf_prefix``: dense MLPs (Qwen3.5) or,
    with ``cfg.moe``, sparse ones on ``cfg.sparse_layers()``; ``interleaved``: Qwen3-Next's fused
    linear projections (module doc)."""
    h = cfg.hidden_size
    mc = MEGATRON_TEXT if cfg.carried else ""  # Bridge's Qwen3VLModel holds the text GPT as language_model
    dec = _LayerTables(cfg, padded_vocab_size, f"{hf_prefix}layers.{{i}}.", mc + "decoder.layers.{i}.",
                       "model.layers.{i}.", interleaved)
    linear, merged = dec.linear()
    full = dec.full_attention()
    dense, sparse = dec.dense_mlp(), dec.sparse_mlp(hf_prefix)
    mtp = _LayerTables(cfg, padded_vocab_size, MTP_PREFIX + "layers.{i}.", mc + MTP_LAYER_MEGATRON,
                       MTP_PREFIX + "layers.{i}.", interleaved)
    mtp_mlp = mtp.sparse_mlp(MTP_PREFIX, mtp=True) if cfg.moe is not None else mtp.dense_mlp()
    mtp_layer = mtp.full_attention() + mtp_mlp + mtp.norms("full", cfg.moe is not None)
    rep = Replicated()
    mtp_head = (
        WeightEntry("mtp.fc.weight", ("mtp.fc.weight",), (Split(0),), mc + "mtp.layers.0.eh_proj.weight",
                    shapes=((h, 2 * h),)),
        *(WeightEntry(f"mtp.{hf}.weight", (f"mtp.{hf}.weight",), (rep,), f"{mc}mtp.layers.0.{name}.weight",
                      shapes=((h,),))
          for hf, name in (("pre_fc_norm_embedding", "enorm"), ("pre_fc_norm_hidden", "hnorm"),
                           ("norm", "final_layernorm"))),
    )
    vocab = Vocab(cfg.vocab_size, padded_vocab_size)
    first = (WeightEntry("model.embed_tokens.weight", (hf_prefix + "embed_tokens.weight",), (vocab,),
                         mc + "embedding.word_embeddings.weight", VOCAB_PADDED, shapes=((cfg.vocab_size, h),)),)
    last = [WeightEntry("model.norm.weight", (hf_prefix + "norm.weight",), (rep,),
                        mc + "decoder.final_layernorm.weight", shapes=((h,),))]
    if not cfg.tie_word_embeddings:
        last.append(WeightEntry("lm_head.weight", (hf_lm_head,), (vocab,), mc + "output_layer.weight", VOCAB_PADDED,
                                shapes=((cfg.vocab_size, h),)))
    return HybridWeightMap(
        full + dense + dec.norms("full", False), first, tuple(last), full + sparse + dec.norms("full", True),
        cfg.sparse_layers(),
        linear_layer_entries=linear + dense + dec.norms("linear", False), linear_layers=cfg.linear_layers(),
        linear_moe_layer_entries=linear + sparse + dec.norms("linear", True),
        conversion_linear=merged + dense + dec.norms("linear", False),
        conversion_linear_moe=merged + sparse + dec.norms("linear", True),
        mtp_layer_entries=mtp_layer, mtp_head_entries=mtp_head,
        carried_entries=tuple(tower_entry(name, shape) for name, shape in cfg.carried))


def tower_entry(name: str, shape: tuple[int, ...]) -> WeightEntry:
    """A vision-tower tensor (module doc): its Megatron name, megatron-core's TP split as the rule, ``qkv``
    reordered per head. The one rule for Qwen3.5's carried tower and Qwen3-VL's (DeepStack mergers included:
    ``converters/layout/model.bridge_qwen3_vl_weight_map``)."""
    megatron, split, qkv = tower_megatron(name)
    rule = Split(0) if split == COLUMN else Split(1) if split == ROW and len(shape) > 1 else Replicated()
    return WeightEntry(name, (name,), (rule,), megatron, TOWER_QKV if qkv else PLAIN, shapes=(shape,))


class _LayerTables:
    """The templates of one kind of decoder layer: HF names under ``hf_layer`` (``model.layers.{i}.`` or the
    MTP block's ``mtp.layers.{i}.``), Megatron names under ``mc_layer``, internal names under ``param``."""

    def __init__(self, cfg: HybridModelConfig, padded_vocab: int, hf_layer: str, mc_layer: str, param: str,
                 interleaved: bool) -> None:
        self.cfg, self.padded_vocab, self.interleaved = cfg, padded_vocab, interleaved
        self.hf_layer, self.mc_layer, self.param = hf_layer, mc_layer, param

    def entry(self, name: str, hf_parts: tuple[str, ...], rules, shapes, megatron: str | None, layout: str = PLAIN,
              parts: tuple[str, ...] = ()) -> WeightEntry:
        return WeightEntry(self.param + name, tuple(self.hf_layer + p for p in hf_parts), tuple(rules),
                           None if megatron is None else self.mc_layer + megatron, layout, shapes=tuple(shapes),
                           megatron_parts=parts)

    def full_attention(self) -> tuple[WeightEntry, ...]:
        cfg = self.cfg
        h, hd, kv_heads = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads
        kv = KVHeads(hd, kv_heads)
        q_rows = (2 if cfg.attn_output_gate else 1) * cfg.num_attention_heads * hd
        sa = "self_attention."
        return (
            self.entry("self_attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                     "self_attn.v_proj.weight"), (Split(0), kv, kv),
                       ((q_rows, h), (kv_heads * hd, h), (kv_heads * hd, h)), sa + "linear_qkv.weight", QKV_GATED),
            self.entry("self_attn.o_proj.weight", ("self_attn.o_proj.weight",), (Split(1),),
                       ((h, cfg.num_attention_heads * hd),), sa + "linear_proj.weight"),
            self.entry("self_attn.q_norm.weight", ("self_attn.q_norm.weight",), (Replicated(),), ((hd,),),
                       sa + "q_layernorm.weight"),
            self.entry("self_attn.k_norm.weight", ("self_attn.k_norm.weight",), (Replicated(),), ((hd,),),
                       sa + "k_layernorm.weight"),
        )

    def linear(self) -> tuple[tuple[WeightEntry, ...], tuple[WeightEntry, ...]]:
        """(the model's linear-attention templates, the same with the projections merged for Megatron)."""
        cfg = self.cfg
        h = cfg.hidden_size
        kd, vd, hv = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
        hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qkv, col = Blocks((kd, kd, vd)), Split(0)
        lin, sa = "linear_attn.", "self_attention."
        rep_v = hv // max(hk, 1)  # value heads per key-head group
        if self.interleaved:
            projections = (
                self.entry(lin + "in_proj_qkvz.weight", (lin + "in_proj_qkvz.weight",),
                           (Groups((dk, dk, rep_v * dv, rep_v * dv), hk),), ((2 * kd + 2 * vd, h),), None),
                self.entry(lin + "in_proj_ba.weight", (lin + "in_proj_ba.weight",), (Groups((rep_v, rep_v), hk),),
                           ((2 * hv, h),), None),
            )
        else:
            projections = (
                self.entry(lin + "in_proj_qkvz.weight", (lin + "in_proj_qkv.weight", lin + "in_proj_z.weight"),
                           (qkv, col), ((2 * kd + vd, h), (vd, h)), None),
                self.entry(lin + "in_proj_ba.weight", (lin + "in_proj_b.weight", lin + "in_proj_a.weight"),
                           (col, col), ((hv, h), (hv, h)), None),
            )
        qkvz, ba = projections
        in_proj = WeightEntry(self.param + lin + "in_proj", qkvz.hf + ba.hf, qkvz.rules + ba.rules,
                              self.mc_layer + sa + "in_proj.weight", PACKED, shapes=qkvz.shapes + ba.shapes,
                              megatron_parts=IN_PROJ_PARTS)
        rest = (
            self.entry(lin + "conv1d.weight", (lin + "conv1d.weight",), (qkv,),
                       ((2 * kd + vd, 1, cfg.linear_conv_kernel_dim),), sa + "conv1d.weight", PACKED, CONV_PARTS),
            self.entry(lin + "A_log", (lin + "A_log",), (col,), ((hv,),), sa + "A_log"),
            self.entry(lin + "dt_bias", (lin + "dt_bias",), (col,), ((hv,),), sa + "dt_bias"),
            self.entry(lin + "norm.weight", (lin + "norm.weight",), (Replicated(),), ((dv,),), sa + "out_norm.weight",
                       MINUS_ONE),
            self.entry(lin + "out_proj.weight", (lin + "out_proj.weight",), (Split(1),), ((h, vd),),
                       sa + "out_proj.weight"),
        )
        return projections + rest, (in_proj,) + rest

    def dense_mlp(self) -> tuple[WeightEntry, ...]:
        h, inter = self.cfg.hidden_size, self.cfg.intermediate_size
        return (
            self.entry("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), (Split(0), Split(0)),
                       ((inter, h), (inter, h)), "mlp.linear_fc1.weight", GATE_UP_STACKED),
            self.entry("mlp.down_proj.weight", ("mlp.down_proj.weight",), (Split(1),), ((h, inter),),
                       "mlp.linear_fc2.weight"),
        )

    def sparse_mlp(self, hf_prefix: str, mtp: bool = False) -> tuple[WeightEntry, ...]:
        """The sparse MLP of ``moe_decoder_weight_map`` (decoder under ``hf_prefix``), its Megatron names under this
        table's layer prefix (``language_model.`` in a conditional-generation checkpoint), internal names the MTP
        layer's with ``mtp``; empty without ``cfg.moe``."""
        if self.cfg.moe is None:
            return ()
        entries = [e for e in moe_decoder_weight_map(self.cfg, self.padded_vocab, hf_prefix=hf_prefix).moe_layer_entries
                   if ".mlp." in e.param]
        layer = "decoder.layers.{i}."  # moe_decoder_weight_map's Megatron layer prefix
        return tuple(replace(e, param=self.param + "mlp." + e.param.split(".mlp.", 1)[1] if mtp else e.param,
                             megatron=self.mc_layer + e.megatron[len(layer):]) for e in entries)

    def norms(self, attention: str, sparse: bool) -> tuple[WeightEntry, ...]:
        """The two layer norms, named in Megatron by the module that holds them (Transformer Engine fuses the
        input norm into ``linear_qkv`` / ``in_proj`` and a dense MLP's norm into ``linear_fc1``; a sparse MLP
        keeps ``pre_mlp_layernorm``)."""
        h, rep = self.cfg.hidden_size, Replicated()
        fused = "self_attention.linear_qkv" if attention == "full" else "self_attention.in_proj"
        return (
            self.entry("input_layernorm.weight", ("input_layernorm.weight",), (rep,), ((h,),),
                       f"{fused}.layer_norm_weight"),
            self.entry("post_attention_layernorm.weight", ("post_attention_layernorm.weight",), (rep,), ((h,),),
                       "pre_mlp_layernorm.weight" if sparse else "mlp.linear_fc1.layer_norm_weight"),
        )
