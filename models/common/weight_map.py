"""The declarative weight map of a dense decoder: which HF tensors pack into which parallel
parameter, under which sharding rule, and which megatron-core tensor (and layout) they correspond to.

Plain data, importable without torch (the converters' copy path reads it without loading torch);
``models.common.weights`` adds the loader and exporter that apply it to tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
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

# HF tensors that may sit in a checkpoint and carry no weights we need.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class WeightEntry:
    """One parallel parameter: ``param`` packs ``hf`` names (each sharded by its rule) along dim 0."""

    param: str
    hf: tuple[str, ...]
    rules: tuple[Rule, ...]
    megatron: str | None = None
    megatron_layout: str = PLAIN

    @property
    def packed(self) -> "Packed":
        from parallel.sharding import Packed

        return Packed(tuple(zip(self.hf, self.rules)))

    def format(self, layer: int) -> "WeightEntry":
        return WeightEntry(self.param.format(i=layer), tuple(h.format(i=layer) for h in self.hf), self.rules,
                           self.megatron.format(i=layer) if self.megatron else None, self.megatron_layout)


@dataclass(frozen=True)
class WeightMap:
    """Per-layer templates (``{i}`` = global layer index) plus the non-layer entries."""

    layer_entries: tuple[WeightEntry, ...]
    first_entries: tuple[WeightEntry, ...]  # embedding (first pipeline stage)
    last_entries: tuple[WeightEntry, ...]  # final norm, lm_head (last pipeline stage)

    def entries(self, layers: Iterable[int], first: bool = True, last: bool = True) -> list[WeightEntry]:
        out = list(self.first_entries) if first else []
        for i in layers:
            out.extend(e.format(i) for e in self.layer_entries)
        if last:
            out.extend(self.last_entries)
        return out


def dense_decoder_weight_map(cfg: ModelConfig, padded_vocab_size: int, *, hf_prefix: str = "model.",
                             hf_lm_head: str = "lm_head.weight") -> WeightMap:
    """Weight map of the Llama/Qwen2 block family; biases and tying come from ``cfg``.

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
    h, hd = cfg.hidden_size, cfg.head_dim
    shapes = {}
    for entry in weight_map.entries(range(cfg.num_hidden_layers)):
        for name in entry.hf:
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
            shapes[name] = shape[:1] if kind == "bias" else shape
    return shapes
