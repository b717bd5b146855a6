"""HybridModelConfig: ModelConfig plus what the Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) add:
linear-attention layers chosen per layer by ``layer_types``, a gated full-attention block with
partial rotary, and zero-centred RMSNorms. Plain data (no torch), like ``models/common/config.py``.

Field names are transformers' (``linear_num_key_heads`` ...), so ``ParallelConfig.validate`` reads
them from either config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Callable

from models.common.config import ModelConfig, MoeConfig, UnsupportedConfigError, rope_from_hf

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)


@dataclass(frozen=True)
class HybridModelConfig(ModelConfig):
    """A decoder whose layers are Gated DeltaNet (``linear_attention``) or gated full attention.

    Linear layers: ``linear_num_key_heads`` (Hk) query/key heads of ``linear_key_head_dim`` (dk),
    ``linear_num_value_heads`` (Hv, a multiple of Hk; value head j reads key head j // (Hv/Hk)) of
    ``linear_value_head_dim`` (dv), a causal depthwise conv of ``linear_conv_kernel_dim`` taps.
    Full-attention layers: ``q_proj`` carries a per-head output gate (``attn_output_gate``), q/k norms,
    RoPE on the first ``rotary_dim`` channels of each head. ``zero_centered_norm``: the decoder's
    RMSNorms (layer, final, q/k) scale by ``1 + w`` (the gated norm of the linear layer does not).
    """

    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = True
    zero_centered_norm: bool = True
    # Where the checkpoint keeps the decoder (``model.``: a CausalLM checkpoint; ``model.language_model.``: a
    # conditional-generation one) and the tensors it holds that the model does not (a conditional-generation
    # checkpoint's vision tower, ``(name, shape)``: models/common/hybrid/vision.py), carried by conversions.
    hf_prefix: str = "model."
    carried: tuple[tuple[str, tuple[int, ...]], ...] = ()
    vision_heads: int = 0  # the carried tower's attention heads (its Megatron qkv is ordered per head)

    @property
    def rotary_dim(self) -> int:
        """Channels of each full-attention head that RoPE rotates (transformers: ``int(head_dim * factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the depthwise conv: ``[q | k | v]``."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def linear_layers(self) -> frozenset[int]:
        return frozenset(i for i in range(self.num_hidden_layers) if self.attention_type(i) == LINEAR_ATTENTION)


def hybrid_config_from_hf(hf_config: Any, *, architecture: str, moe: MoeConfig | None = None) -> HybridModelConfig:
    """Read a Qwen3.5-style text config (``Qwen3_5TextConfig``, ``Qwen3_5MoeTextConfig``,
    ``Qwen3NextConfig``); refuse, in one line naming the numbers, what these blocks do not compute.
    ``moe``: the sparse MLP (its layers from ``moe.is_sparse``); Qwen3.5-MoE has no dense MLP and no
    ``intermediate_size`` (0 here)."""
    def get(name, default=None):
        return getattr(hf_config, name, default)

    act = get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedConfigError(f"{architecture}: hidden_act={act!r} is not supported (only silu)")
    if get("attention_bias", False):
        raise UnsupportedConfigError(f"{architecture}: attention_bias=True is not supported yet")
    layers = int(hf_config.num_hidden_layers)
    layer_types = tuple(str(t) for t in (get("layer_types") or ()))
    if len(layer_types) != layers:
        raise UnsupportedConfigError(f"{architecture}: layer_types has {len(layer_types)} entries for "
                                     f"num_hidden_layers={layers}")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        where = [i for i, t in enumerate(layer_types) if t not in LAYER_TYPES][:8]
        raise UnsupportedConfigError(f"{architecture}: layer_types has {', '.join(map(repr, unknown))} (layers "
                                     f"{where}); known: {', '.join(LAYER_TYPES)}")
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(get("num_key_value_heads") or heads)
    head_dim = int(get("head_dim") or hf_config.hidden_size // heads)
    hk, hv = int(get("linear_num_key_heads", 0)), int(get("linear_num_value_heads", 0))
    dk, dv = int(get("linear_key_head_dim", 0)), int(get("linear_value_head_dim", 0))
    kernel = int(get("linear_conv_kernel_dim", 4))
    if LINEAR_ATTENTION in layer_types:
        if min(hk, hv, dk, dv, kernel) < 1:
            raise UnsupportedConfigError(f"{architecture}: linear attention needs positive sizes, got "
                                         f"linear_num_key_heads={hk} linear_num_value_heads={hv} "
                                         f"linear_key_head_dim={dk} linear_value_head_dim={dv} "
                                         f"linear_conv_kernel_dim={kernel}")
        if hv % hk:
            raise UnsupportedConfigError(f"{architecture}: linear_num_value_heads={hv} is not a multiple of "
                                         f"linear_num_key_heads={hk}")
    params = dict(get("rope_parameters") or {})
    partial = float(params.pop("partial_rotary_factor", get("partial_rotary_factor", 1.0)) or 1.0)
    # text-only positions are one row, where M-RoPE's sections (and their interleaving) change nothing
    for key in ("mrope_section", "mrope_interleaved"):
        params.pop(key, None)
    rope = rope_from_hf(SimpleNamespace(rope_parameters=params, rope_theta=get("rope_theta", 10000.0)))
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise UnsupportedConfigError(f"{architecture}: partial_rotary_factor={partial} with head_dim={head_dim} "
                                     f"gives {rotary_dim} rotary channels (need an even number in 2..{head_dim})")
    return HybridModelConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=int(get("intermediate_size") or 0),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=get("max_position_embeddings", 2048),
        rms_norm_eps=get("rms_norm_eps", 1e-6),
        rope=rope,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        hidden_act="silu",
        initializer_range=get("initializer_range", 0.02),
        architecture=architecture,
        qk_norm=True,
        layer_types=layer_types,
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=kernel,
        partial_rotary_factor=partial,
        attn_output_gate=True,
        zero_centered_norm=True,
        moe=moe,
    )


def hybrid_checkpoint_config(hf_config: Any, read: Callable[[Any], HybridModelConfig]) -> HybridModelConfig:
    """The config of a CausalLM checkpoint (``read(hf_config)``) or of a conditional-generation one
    (``Qwen3_5Config`` / ``Qwen3_5MoeConfig``: ``read(text_config)``, the decoder under
    ``model.language_model.``, the vision tower carried, embeddings tied as the top-level config says, which
    is what transformers' ``Qwen3_5ForConditionalGeneration`` reads)."""
    from models.common.hybrid.vision import TEXT_PREFIX, vision_heads, vision_tensors

    text = getattr(hf_config, "text_config", None)
    if text is None:
        return read(hf_config)
    if isinstance(text, dict):  # the converters' config view (config.json as data) keeps sub-configs as dicts
        text = SimpleNamespace(**text)
    cfg = read(text)
    vision = getattr(hf_config, "vision_config", None)
    try:
        carried = vision_tensors(vision) if vision is not None else ()
        heads = vision_heads(vision) if vision is not None else 0
    except (TypeError, ValueError) as exc:
        raise UnsupportedConfigError(f"{cfg.architecture}: vision_config: {exc}") from None
    if carried and (heads < 1 or carried[0][1][0] % heads):
        raise UnsupportedConfigError(f"{cfg.architecture}: vision_config: hidden_size={carried[0][1][0]} is not "
                                     f"divisible by num_heads={heads}")
    return replace(cfg, hf_prefix=TEXT_PREFIX, carried=carried, vision_heads=heads,
                   tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))
