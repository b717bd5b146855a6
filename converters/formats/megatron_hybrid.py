"""Megatron args of the Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), both ways, torch-free.

What megatron-core 0.19.2 / Megatron-LM need to build these models (the fields Megatron-Bridge 0.6.2's
``qwen35_bridge.py`` and ``qwen3_next_bridge.py`` set on the provider): ``experimental_attention_variant=
"gated_delta_net"`` (the Transformer-Engine spec, ``transformer_impl="transformer_engine"``: megatron-core
builds these layers with no other), ``linear_attention_freq`` (an int N: layer i is full attention iff
``(i + 1) % N == 0``; else a 0/1 list, 1 = linear attention), ``linear_{num_key_heads, num_value_heads,
key_head_dim, value_head_dim, conv_kernel_dim}``, ``attention_output_gate`` (the per-head gate in q_proj),
``layernorm_zero_centered_gamma`` (every decoder RMSNorm is ``x * (1 + w)``), ``rotary_percent`` (the
partial rotary factor), ``qk_layernorm``, ``kv_channels``, and ``mtp_num_layers`` when the checkpoint
holds the MTP block. Mixture-of-experts fields are ``megatron_moe``'s.

Reading, the args must describe the model the HF config does (``hybrid_mismatches``); without an HF config
they give one (``hybrid_hf_config``). Megatron stores Qwen3.5-MoE and Qwen3-Next identically (the HF
layouts of their linear projections differ), so args without ``hf_model_type`` (which pmz records) name
neither: ``--arch`` or ``--hf-config`` does.
"""

from __future__ import annotations

from typing import Any

from converters.formats.hf_config import HFConfig, _transformers_version
from converters.formats.megatron_moe import arg_value, check_hf_against_args, moe_hf_fields, num_experts_of
from models.common.config import UnsupportedConfigError
from models.common.errors import CheckpointError

GDN = "gated_delta_net"
# HF model_type <-> pmz architecture name (--arch)
MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_next": "qwen3_next"}
LINEAR, FULL = "linear_attention", "full_attention"


def is_hybrid_args(args: Any) -> bool:
    return arg_value(args, "experimental_attention_variant") == GDN


def linear_attention_freq(layer_types: tuple[str, ...]) -> int | list[int]:
    """megatron-core's ``linear_attention_freq`` for HF ``layer_types``: the interval N when every N-th layer
    (and only it) is full attention, else the 0/1 pattern (1 = linear attention)."""
    pattern = [1 if t == LINEAR else 0 for t in layer_types]
    for n in range(1, len(pattern) + 1):
        if pattern == [0 if (i + 1) % n == 0 else 1 for i in range(len(pattern))]:
            return n
    return pattern


def layer_types_of(args: Any, num_layers: int, where: str) -> list[str]:
    """HF ``layer_types`` from ``linear_attention_freq`` (as megatron-core expands it)."""
    freq = arg_value(args, "linear_attention_freq")
    if isinstance(freq, bool) or not isinstance(freq, (int, list, tuple)) or (isinstance(freq, int) and freq < 1):
        raise UnsupportedConfigError(f"{where}: linear_attention_freq={freq!r}: expected a positive integer or a 0/1 "
                                     f"list per layer")
    if isinstance(freq, int):
        return [FULL if (i + 1) % freq == 0 else LINEAR for i in range(num_layers)]
    pattern = list(freq)
    if len(pattern) != num_layers or set(pattern) - {0, 1}:
        raise UnsupportedConfigError(f"{where}: linear_attention_freq {pattern} needs one 0/1 entry per layer "
                                     f"(num_layers={num_layers})")
    return [LINEAR if x else FULL for x in pattern]


def hybrid_arg_fields(cfg: Any, mtp_layers: int) -> dict[str, Any]:
    """The args that make megatron-core build the hybrid ``cfg`` (HybridModelConfig); MoE ones aside."""
    return dict(
        experimental_attention_variant=GDN, linear_attention_freq=linear_attention_freq(cfg.layer_types),
        linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, attention_output_gate=bool(cfg.attn_output_gate),
        layernorm_zero_centered_gamma=bool(cfg.zero_centered_norm), rotary_percent=cfg.partial_rotary_factor,
        mtp_num_layers=mtp_layers or None, transformer_impl="transformer_engine",
    )


def hybrid_model_type(args: Any, arch: str | None, where: str) -> str:
    """The HF model_type of hybrid args: ``--arch``, else the ``hf_model_type`` pmz records, else from the
    args (no experts: Qwen3.5; experts: ambiguous, refused)."""
    if arch is not None:
        if arch not in MODEL_TYPES:
            raise CheckpointError(f"{where}: --arch {arch}: the Megatron args describe a Gated DeltaNet hybrid "
                                  f"({', '.join(MODEL_TYPES)})")
        return MODEL_TYPES[arch]
    recorded = arg_value(args, "hf_model_type")
    if recorded in MODEL_TYPES.values():
        return recorded
    if not num_experts_of(args):
        return MODEL_TYPES["qwen3_5"]
    raise CheckpointError(f"{where}: Megatron args of a Gated DeltaNet mixture-of-experts model store Qwen3.5-MoE and "
                          f"Qwen3-Next alike: pass --arch qwen3_5_moe or --arch qwen3_next (or --hf-config DIR)")


def hybrid_hf_config(args: Any, common: dict[str, Any], model_type: str, where: str) -> HFConfig:
    """A config.json transformers loads for hybrid args (``common``: the fields every architecture shares)."""
    layers = common["num_hidden_layers"]
    partial = float(arg_value(args, "rotary_percent", 1.0))
    rope = {"rope_type": "default", "rope_theta": float(arg_value(args, "rotary_base", 10000)),
            "partial_rotary_factor": partial}
    fields: dict[str, Any] = dict(common, layer_types=layer_types_of(args, layers, where), rope_parameters=rope,
                                  attention_bias=False, hidden_act="silu", initializer_range=0.02, use_cache=True,
                                  attention_dropout=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim"):
        fields[name] = int(arg_value(args, name, 0))
    mtp = int(arg_value(args, "mtp_num_layers", 0) or 0)
    if mtp:
        fields["mtp_num_hidden_layers"] = mtp
    if num_experts_of(args):
        moe = moe_hf_fields(args, layers, common["intermediate_size"], where)
        moe.pop("qkv_bias")
        if model_type == MODEL_TYPES["qwen3_5_moe"]:
            if moe["mlp_only_layers"] or not moe["norm_topk_prob"]:
                raise UnsupportedConfigError(f"{where}: not a Qwen3.5-MoE model: every layer of it is sparse and "
                                             f"renormalises its top-k (moe_layer_freq dense layers "
                                             f"{moe['mlp_only_layers']}, moe_router_pre_softmax="
                                             f"{not moe['norm_topk_prob']})")
            for name in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
                moe.pop(name)
            fields.pop("intermediate_size")
        fields.update(moe)
    base = {"architectures": [_CLASS[model_type]], "model_type": model_type, **fields}
    version = _transformers_version()
    if version:
        base["transformers_version"] = version
    return HFConfig(base)


_CLASS = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
          "qwen3_next": "Qwen3NextForCausalLM"}


def hybrid_mismatches(config: Any, cfg: Any, args: Any, where: str, hf_dir: str) -> list[str]:
    """What hybrid args say that the HF config (``config`` as read, ``cfg`` its model config) does not."""
    bad = []
    if not is_hybrid_args(args):
        return [f"experimental_attention_variant={arg_value(args, 'experimental_attention_variant')!r} vs the "
                f"{config.model_type} config's Gated DeltaNet layers ({GDN!r})"]
    recorded = arg_value(args, "hf_model_type")
    if recorded is not None and recorded != config.model_type:
        bad.append(f"model_type={config.model_type} vs args' hf_model_type={recorded}")
    layer_types = layer_types_of(args, int(args.num_layers), where)
    if tuple(layer_types) != tuple(cfg.layer_types):
        bad.append(f"layer_types {list(cfg.layer_types)} vs linear_attention_freq "
                   f"{arg_value(args, 'linear_attention_freq')!r}")
    pairs = [(name, getattr(cfg, name), arg_value(args, name)) for name in (
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "linear_conv_kernel_dim")]
    pairs += [("partial_rotary_factor", cfg.partial_rotary_factor, arg_value(args, "rotary_percent")),
              ("attention output gate", bool(cfg.attn_output_gate), arg_value(args, "attention_output_gate")),
              ("zero-centred norms", bool(cfg.zero_centered_norm), arg_value(args, "layernorm_zero_centered_gamma")),
              ("q/k norms", True, arg_value(args, "qk_layernorm"))]
    bad += [f"{name}={ours} vs args' {theirs}" for name, ours, theirs in pairs if theirs is not None and ours != theirs]
    if (cfg.moe is None) != (not num_experts_of(args)):
        bad.append(f"{'no ' if cfg.moe is None else ''}experts vs args' num_experts={num_experts_of(args)}")
    elif cfg.moe is not None:
        try:
            fields = moe_hf_fields(args, int(args.num_layers), int(arg_value(args, "ffn_hidden_size", 0)), where)
        except UnsupportedConfigError as exc:
            return bad + [str(exc).split(": ", 1)[-1]]
        if config.model_type == MODEL_TYPES["qwen3_next"]:
            bad += check_hf_against_args(config, args, where, hf_dir)
        else:
            bad += [f"{name}={getattr(cfg.moe, attr)} vs args' {fields[name]}" for name, attr in (
                ("num_experts", "num_experts"), ("num_experts_per_tok", "top_k"),
                ("moe_intermediate_size", "moe_intermediate_size"),
                ("shared_expert_intermediate_size", "shared_expert_intermediate_size"))
                if getattr(cfg.moe, attr) != fields[name]]
            if fields["mlp_only_layers"] or not fields["norm_topk_prob"]:
                bad.append("Qwen3.5-MoE is sparse on every layer and renormalises, the args are not")
    return bad
