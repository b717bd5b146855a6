"""The declarative weight map of a dense decoder: which HF tensors pack into which parallel
parameter, under which sharding rule, and which megatron-core tensor (and layout) they correspond to.

Plain data, importable without torch (the converters' copy path reads it without loading torch);
``models.common.weights`` adds the loader and exporter that apply it to tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable

from models.common.config import ModelConfig
from parallel.sharding import KVHeads, Replicated, Rule, Split, Vocab

if TYPE_CHECKING:
    from parallel.sharding import Packed

# megatron-core layouts a converter must translate (see docs/formats.md):
PLAIN = "plain"  # same tensor in both
QKV_INTERLEAVED = "qkv_interleaved"  # mcore linear_qkv: per query group [q heads of g, k_g, v_g]
GATE_UP_STACKED = "gate_up_stacked"  # mcore linear_fc1: [gate; up]
VOCAB_PADDED = "vocab_padded"  # mcore pads vocab rows to its own multiple
# the Gated DeltaNet hybrids (models/common/hybrid/weights.py; converters/layout/megatron.py applies them):
QKV_GATED = "qkv_gated_interleaved"  # mcore linear_qkv with attention_output_gate: per group [q | gates | k_g | v_g]
PACKED = "packed_components"  # the parts' row components in order (sharding rules at TP 1); a legacy TP shard is
#                               the entry's packed parameter shard, torch_dist one global tensor per component
MINUS_ONE = "minus_one"  # mcore value = HF value - 1 (a plain RMSNorm weight held zero-centred by Megatron)

# HF tensors that may sit in a checkpoint and carry no weights we need.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class WeightEntry:
    """One parallel parameter: ``param`` packs ``hf`` names (each sharded by its rule) along dim 0.

    Expert entries (``experts`` = E > 0) describe a stack ``[E_local, ...]`` of per-expert packed
    tensors: the templates name one expert with ``{e}`` and ``format`` expands ``hf`` to all E
    experts in order (``hf[e*k:(e+1)*k]`` are expert e's k parts, each under ``rules[j]``); the
    parameter of expert-parallel rank r holds experts ``[r*E/ep, (r+1)*E/ep)``. ``megatron`` keeps
    its ``{e}`` (converters put the expert id Megatron uses there).
    ``shapes``: full HF shape of each part (one expert's, for expert entries); None = inferred from
    the module name (the dense decoder's tensors, see ``hf_shapes``).
    ``megatron_parts``: for ``PACKED`` entries, the name of each row component (megatron-core's torch_dist
    key suffixes: ``in_proj.weight.query`` ...), one per component of the parts' rules.
    """

    param: str
    hf: tuple[str, ...]
    rules: tuple[Rule, ...]
    megatron: str | None = None
    megatron_layout: str = PLAIN
    experts: int = 0
    shapes: tuple[tuple[int, ...], ...] | None = None
    megatron_parts: tuple[str, ...] = ()

    @property
    def packed(self) -> "Packed":
        """How one parameter (one expert's slice, for expert entries) packs its parts."""
        from parallel.sharding import Packed

        return Packed(tuple(zip(self.hf, self.rules)))

    @property
    def parts(self) -> int:
        """HF tensors per packed parameter (per expert for expert entries)."""
        return len(self.rules)

    def expert_hf(self, e: int) -> tuple[str, ...]:
        """The HF names of expert ``e`` (a formatted expert entry)."""
        return self.hf[e * self.parts:(e + 1) * self.parts]

    def expert(self, e: int) -> "WeightEntry":
        """Expert ``e`` of a formatted expert entry as a plain entry (its names, rules and Megatron name)."""
        mc = self.megatron.replace("{e}", str(e)) if self.megatron else None
        return replace(self, hf=self.expert_hf(e), megatron=mc, experts=0)

    def format(self, layer: int) -> "WeightEntry":
        def fill(name: str) -> str:
            return name.replace("{i}", str(layer))

        hf = tuple(fill(h) for h in self.hf)
        if self.experts:
            hf = tuple(h.replace("{e}", str(e)) for e in range(self.experts) for h in hf)
        return replace(self, param=fill(self.param), hf=hf, megatron=fill(self.megatron) if self.megatron else None)


@dataclass(frozen=True)
class WeightMap:
    """Per-layer templates (``{i}`` = global layer index) plus the non-layer entries.

    ``moe_layer_entries`` replace ``layer_entries`` for the layers in ``moe_layers`` (mixture-of-experts
    MLPs; empty for dense models).

    ``fused_experts``: HF checkpoints of this model store each sparse layer's experts fused, as transformers
    reads them (Qwen3-VL-MoE: ``mlp.experts.gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``); the entries
    still name them per expert and the HF writers store them through ``hf_files.fused_expert_layout``.
    False: per expert (``mlp.experts.{e}.gate_proj.weight`` ...), which transformers fuses on load itself.
    """

    layer_entries: tuple[WeightEntry, ...]
    first_entries: tuple[WeightEntry, ...]  # embedding (first pipeline stage)
    last_entries: tuple[WeightEntry, ...]  # final norm, lm_head (last pipeline stage)
    moe_layer_entries: tuple[WeightEntry, ...] = ()
    moe_layers: frozenset[int] = frozenset()
    fused_experts: bool = False

    @property
    def has_experts(self) -> bool:
        return bool(self.moe_layers)

    def layer_templates(self, layer: int) -> tuple[WeightEntry, ...]:
        return self.moe_layer_entries if layer in self.moe_layers else self.layer_entries

    def entries(self, layers: Iterable[int], first: bool = True, last: bool = True) -> list[WeightEntry]:
        out = list(self.first_entries) if first else []
        for i in layers:
            out.extend(e.format(i) for e in self.layer_templates(i))
        if last:
            out.extend(self.last_entries)
        return out


def dense_decoder_weight_map(cfg: ModelConfig, padded_vocab_size: int, *, hf_prefix: str = "model.",
                             hf_lm_head: str = "lm_head.weight") -> WeightMap:
    """Weight map of the Llama/Qwen2/Qwen3 block family; biases, q/k norms and tying come from ``cfg``.

    ``hf_prefix`` is where the decoder sits in HF names ("model." for Llama/Qwen2,
    "model.language_model." for Qwen2-VL's text model).
    """
    col, row, rep = Split(0), Split(1), Replicated()
    kv = KVHeads(cfg.head_dim, cfg.num_key_value_heads)
    layer = f"{hf_prefix}layers.{{i}}."
    mc = "decoder.layers.{i}."
    entries = [
        WeightEntry("model.layers.{i}.self_attn.qkv_proj.weight",
                    tuple(layer + f"self_attn.{p}_proj.weight" for p in "qkv"), (col, kv, kv),
                    mc + "self_attention.linear_qkv.weight", QKV_INTERLEAVED),
    ]
    if cfg.qkv_bias:
        entries.append(WeightEntry("model.layers.{i}.self_attn.qkv_proj.bias",
                                   tuple(layer + f"self_attn.{p}_proj.bias" for p in "qkv"), (col, kv, kv),
                                   mc + "self_attention.linear_qkv.bias", QKV_INTERLEAVED))
    entries.append(WeightEntry("model.layers.{i}.self_attn.o_proj.weight", (layer + "self_attn.o_proj.weight",), (row,),
                               mc + "self_attention.linear_proj.weight"))
    if cfg.o_bias:
        entries.append(WeightEntry("model.layers.{i}.self_attn.o_proj.bias", (layer + "self_attn.o_proj.bias",), (rep,),
                                   mc + "self_attention.linear_proj.bias"))
    if cfg.qk_norm:  # Qwen3's per-head RMSNorm weights [head_dim], whole on every TP rank (vLLM: same names)
        entries += [WeightEntry(f"model.layers.{{i}}.self_attn.{p}_norm.weight",
                                (layer + f"self_attn.{p}_norm.weight",), (rep,),
                                mc + f"self_attention.{p}_layernorm.weight", shapes=((cfg.head_dim,),))
                    for p in "qk"]
    entries.append(WeightEntry("model.layers.{i}.mlp.gate_up_proj.weight",
                               (layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"), (col, col),
                               mc + "mlp.linear_fc1.weight", GATE_UP_STACKED))
    if cfg.mlp_bias:
        entries.append(WeightEntry("model.layers.{i}.mlp.gate_up_proj.bias",
                                   (layer + "mlp.gate_proj.bias", layer + "mlp.up_proj.bias"), (col, col),
                                   mc + "mlp.linear_fc1.bias", GATE_UP_STACKED))
    entries.append(WeightEntry("model.layers.{i}.mlp.down_proj.weight", (layer + "mlp.down_proj.weight",), (row,),
                               mc + "mlp.linear_fc2.weight"))
    if cfg.mlp_bias:
        entries.append(WeightEntry("model.layers.{i}.mlp.down_proj.bias", (layer + "mlp.down_proj.bias",), (rep,),
                                   mc + "mlp.linear_fc2.bias"))
    entries += [
        WeightEntry("model.layers.{i}.input_layernorm.weight", (layer + "input_layernorm.weight",), (rep,),
                    mc + "input_layernorm.weight"),
        WeightEntry("model.layers.{i}.post_attention_layernorm.weight", (layer + "post_attention_layernorm.weight",),
                    (rep,), mc + "pre_mlp_layernorm.weight"),
    ]
    vocab = Vocab(cfg.vocab_size, padded_vocab_size)
    first = (WeightEntry("model.embed_tokens.weight", (hf_prefix + "embed_tokens.weight",), (vocab,),
                         "embedding.word_embeddings.weight", VOCAB_PADDED),)
    last = [WeightEntry("model.norm.weight", (hf_prefix + "norm.weight",), (rep,), "decoder.final_layernorm.weight")]
    if not cfg.tie_word_embeddings:
        last.append(WeightEntry("lm_head.weight", (hf_lm_head,), (vocab,), "output_layer.weight", VOCAB_PADDED))
    return WeightMap(tuple(entries), first, tuple(last))


def hf_shapes(cfg: ModelConfig, weight_map: WeightMap) -> dict[str, tuple[int, ...]]:
    """Full HF tensor shapes implied by ``cfg`` for every HF name in the map (all layers)."""
    shapes = {}
    for entry in weight_map.entries(range(cfg.num_hidden_layers)):
        if entry.shapes is not None:
            for j, name in enumerate(entry.hf):
                shapes[name] = tuple(entry.shapes[j % entry.parts])
            continue
        for name in entry.hf:
            shapes[name] = _dense_shape(cfg, name)
    return shapes


def _dense_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    h, hd = cfg.hidden_size, cfg.head_dim
    leaf = name.rsplit(".", 2)
    module, kind = leaf[-2], leaf[-1]
    if module == "q_proj":
        shape = (cfg.num_attention_heads * hd, h)
    elif module in ("k_proj", "v_proj"):
        shape = (cfg.num_key_value_heads * hd, h)
    elif module == "o_proj":
        shape = (h, cfg.num_attention_heads * hd)
    elif module in ("gate_proj", "up_proj"):
        shape = (cfg.intermediate_size, h)
    elif module == "down_proj":
        shape = (h, cfg.intermediate_size)
    elif module in ("embed_tokens", "lm_head"):
        shape = (cfg.vocab_size, h)
    else:  # norms
        shape = (h,)
    return shape[:1] if kind == "bias" else shape


def moe_decoder_weight_map(cfg: ModelConfig, padded_vocab_size: int, *, hf_prefix: str = "model.",
                           hf_lm_head: str = "lm_head.weight") -> WeightMap:
    """The dense decoder's map plus Qwen2-MoE's / Qwen3-MoE's sparse MLP on ``cfg.sparse_layers()``.

    Sparse layer ``i`` (HF names as transformers writes them on disk, per expert):
      router        ``mlp.gate.weight [E, H]``                     replicated over TP
      experts       ``mlp.experts.{e}.{gate,up}_proj.weight``      packed per expert into
                    ``mlp.experts.w13_weight [E/ep, 2I, H]`` and ``down_proj`` into
                    ``mlp.experts.w2_weight [E/ep, H, I]`` (vLLM's names): split over EP, whole on
                    every TP rank (each TP rank runs the experts on its own share of the tokens)
      shared expert ``mlp.shared_expert.{gate,up,down}_proj``      column/row over TP like the dense MLP
                    (zero rows when ``shared_expert_intermediate_size`` is 0, as transformers has it)
      shared gate   ``mlp.shared_expert_gate.weight [1, H]``       replicated
                    (neither shared expert nor gate when ``moe.shared_expert`` is False: Qwen3-MoE)
    Megatron names follow megatron-core's local spec (``mlp.router``, ``mlp.experts.local_experts.{e}``,
    ``mlp.shared_experts`` with ``gate_weight``).
    """
    moe = cfg.moe
    assert moe is not None, "moe_decoder_weight_map needs cfg.moe"
    dense = dense_decoder_weight_map(cfg, padded_vocab_size, hf_prefix=hf_prefix, hf_lm_head=hf_lm_head)
    col, row, rep = Split(0), Split(1), Replicated()
    h, e_count, inter = cfg.hidden_size, moe.num_experts, moe.moe_intermediate_size
    layer = f"{hf_prefix}layers.{{i}}.mlp."
    mc = "decoder.layers.{i}.mlp."
    param = "model.layers.{i}.mlp."
    sparse = [e for e in dense.layer_entries if ".mlp." not in e.param]
    sparse.append(WeightEntry(param + "gate.weight", (layer + "gate.weight",), (rep,), mc + "router.weight",
                              shapes=((e_count, h),)))
    sparse.append(WeightEntry(param + "experts.w13_weight",
                              (layer + "experts.{e}.gate_proj.weight", layer + "experts.{e}.up_proj.weight"),
                              (rep, rep), mc + "experts.local_experts.{e}.linear_fc1.weight", GATE_UP_STACKED,
                              experts=e_count, shapes=((inter, h), (inter, h))))
    sparse.append(WeightEntry(param + "experts.w2_weight", (layer + "experts.{e}.down_proj.weight",), (rep,),
                              mc + "experts.local_experts.{e}.linear_fc2.weight", experts=e_count,
                              shapes=((h, inter),)))
    shared = moe.shared_expert_intermediate_size  # 0: zero-size tensors, as transformers writes them
    if moe.shared_expert:  # Qwen3-MoE has no shared-expert tensors at all
        sparse.append(WeightEntry(param + "shared_expert.gate_up_proj.weight",
                                  (layer + "shared_expert.gate_proj.weight", layer + "shared_expert.up_proj.weight"),
                                  (col, col), mc + "shared_experts.linear_fc1.weight", GATE_UP_STACKED,
                                  shapes=((shared, h), (shared, h))))
        sparse.append(WeightEntry(param + "shared_expert.down_proj.weight",
                                  (layer + "shared_expert.down_proj.weight",), (row,),
                                  mc + "shared_experts.linear_fc2.weight", shapes=((h, shared),)))
        sparse.append(WeightEntry(param + "shared_expert_gate.weight", (layer + "shared_expert_gate.weight",), (rep,),
                                  mc + "shared_experts.gate_weight", shapes=((1, h),)))
    norms = [e for e in sparse if e.param.endswith("layernorm.weight")]
    sparse = [e for e in sparse if e not in norms] + norms  # same order as the dense layer: MLP, then norms
    return WeightMap(dense.layer_entries, dense.first_entries, dense.last_entries, tuple(sparse),
                     cfg.sparse_layers())
