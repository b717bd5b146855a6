"""ModelConfig: the architecture-neutral description of a dense decoder-only transformer.

Llama and Qwen2 (and the language half of Qwen2-VL) are the same block with different switches:
qkv bias, o_proj bias, MLP bias, tied embeddings, explicit head_dim, RoPE scaling. Each model
folder turns its transformers config into this dataclass (``config.py`` there); the shared blocks
in ``models/common`` read only this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class UnsupportedConfigError(ValueError):
    """A transformers config that uses a feature these models do not implement (named in the message)."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' ``rope_parameters``, standardized).

    rope_type: "default", "linear", "dynamic" or "llama3".
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # Multimodal RoPE (Qwen2-VL): the head_dim/2 frequencies are cut into these sections, section i
    # rotating by position row i % 3 (temporal, height, width); None = ordinary 1-D RoPE.
    mrope_section: tuple[int, ...] | None = None

    SUPPORTED = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class MoeConfig:
    """Mixture-of-experts switches (transformers' Qwen2-MoE names).

    Routing is Qwen2-MoE's: softmax over all ``num_experts`` router logits (fp32), top-k, the top-k
    weights renormalised to sum to one only when ``norm_topk_prob``. Layer ``i`` is sparse when
    ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; other layers keep the
    dense MLP of ``intermediate_size``. ``shared_expert_intermediate_size == 0``: no shared expert.
    """

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    # False: the architecture has no shared-expert modules at all (Qwen3-MoE), not even the zero-size
    # ones (and the gate) that Qwen2-MoE keeps when ``shared_expert_intermediate_size`` is 0
    shared_expert: bool = True

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class VisionConfig:
    """The Qwen2-VL family's vision tower (transformers' ``Qwen2VLVisionConfig`` names) and its special tokens.

    Patches of ``in_channels x temporal_patch_size x patch_size^2`` pixels are embedded to
    ``embed_dim``, run through ``depth`` pre-LayerNorm blocks (``num_heads`` heads, 2-D rotary,
    quick-GELU MLP of ``embed_dim * mlp_ratio``), and every ``spatial_merge_size^2`` neighbouring
    patches are merged into one ``out_hidden_size`` (the text model's hidden size) feature.

    Qwen2.5-VL's options (defaults: Qwen2-VL): ``rms_norm`` (RMSNorm without bias in the blocks and
    the merger), ``gated_mlp`` (``down(act(gate(x)) * up(x))`` with biases, width ``intermediate_size``),
    ``window_size`` > 0 (attention within windows of ``window_size / (patch_size * spatial_merge_size)``
    merged patches per side, except the blocks in ``fullatt_block_indexes``, which attend per frame),
    and ``tokens_per_second`` (M-RoPE temporal positions of a video step by ``tokens_per_second *
    second_per_grid_ts``; None: by 1, as in Qwen2-VL).
    """

    depth: int
    embed_dim: int
    out_hidden_size: int
    num_heads: int
    mlp_ratio: float = 4.0
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "quick_gelu"
    rope_theta: float = 10000.0
    image_token_id: int = 151655
    video_token_id: int = 151656
    intermediate_size: int | None = None  # MLP width; None: embed_dim * mlp_ratio
    rms_norm: bool = False
    gated_mlp: bool = False
    window_size: int = 0  # 0: no window attention
    fullatt_block_indexes: tuple[int, ...] = ()
    tokens_per_second: float | None = None

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return self.intermediate_size if self.intermediate_size is not None else int(self.embed_dim * self.mlp_ratio)

    @property
    def window_tokens(self) -> int:
        """Merged patches per window side (0: no window attention)."""
        return self.window_size // (self.spatial_merge_size * self.patch_size)

    @property
    def patch_dim(self) -> int:
        """Pixel values per patch row (``pixel_values.shape[1]``)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merged_dim(self) -> int:
        """Width of the patch merger's MLP (``embed_dim * spatial_merge_size^2``)."""
        return self.embed_dim * self.spatial_merge_size ** 2


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and switches of a dense decoder-only model (HF naming where one exists)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    architecture: str = "llama"
    moe: MoeConfig | None = None  # None: every layer has the dense MLP
    # Qwen3: RMSNorm over head_dim on every query and key head (``self_attn.q_norm``/``k_norm``), before RoPE
    qk_norm: bool = False
    # transformers' ``layer_types``: the attention block of each layer; () = every layer "full_attention"
    # (the only one computed; ``from_hf`` refuses others)
    layer_types: tuple[str, ...] = ()
    vision: VisionConfig | None = None  # Qwen2-VL: the vision tower on the first pipeline stage

    def attention_type(self, layer: int) -> str:
        """The attention block of layer ``layer`` (a ``layer_types`` entry)."""
        return self.layer_types[layer] if self.layer_types else "full_attention"

    def sparse_layers(self) -> frozenset[int]:
        """Global indices of the layers whose MLP is a mixture of experts."""
        if self.moe is None:
            return frozenset()
        return frozenset(i for i in range(self.num_hidden_layers) if self.moe.is_sparse(i))

    @classmethod
    def from_hf(cls, hf_config: Any, *, architecture: str, qkv_bias: bool, o_bias: bool,
                mlp_bias: bool, qk_norm: bool = False) -> "ModelConfig":
        """Read the fields shared by Llama-like transformers configs; the caller sets the bias and q/k-norm
        switches."""
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedConfigError(f"{architecture}: hidden_act={act!r} is not supported (only silu)")
        if getattr(hf_config, "use_sliding_window", False):
            raise UnsupportedConfigError(f"{architecture}: use_sliding_window={hf_config.use_sliding_window!r} "
                                         f"(sliding-window attention) is not supported")
        layer_types = list(getattr(hf_config, "layer_types", None) or [])
        other = sorted({str(t) for t in layer_types if t != "full_attention"})
        if other:
            raise UnsupportedConfigError(f"{architecture}: layer_types has {', '.join(map(repr, other))} (layers "
                                         f"{[i for i, t in enumerate(layer_types) if t != 'full_attention'][:8]}); "
                                         f"only 'full_attention' is supported")
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        if head_dim % 2:
            raise UnsupportedConfigError(f"{architecture}: head_dim={head_dim} is odd (hidden_size="
                                         f"{hf_config.hidden_size}, {heads} heads): rotary embeddings rotate pairs")
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", 2048),
            rms_norm_eps=getattr(hf_config, "rms_norm_eps", 1e-6),
            rope=rope_from_hf(hf_config),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            hidden_act="silu",
            initializer_range=getattr(hf_config, "initializer_range", 0.02),
            architecture=architecture,
            qk_norm=qk_norm,
        )


def rope_from_hf(hf_config: Any) -> RopeConfig:
    """RoPE parameters from transformers 5 ``rope_parameters`` or the older ``rope_theta``/``rope_scaling``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in RopeConfig.SUPPORTED:
        raise UnsupportedConfigError(f"rope_type={rope_type!r} is not supported "
                                     f"(supported: {', '.join(RopeConfig.SUPPORTED)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0) or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        mrope_section=tuple(int(x) for x in params["mrope_section"]) if params.get("mrope_section") else None,
    )
