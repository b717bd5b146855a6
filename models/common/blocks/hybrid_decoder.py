"""The decoder of the Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): pre-norm layers whose
token mixer is chosen per layer from ``layer_types`` (``linear_attn``: Gated DeltaNet, ``self_attn``:
gated full attention), the dense MLP or, on the sparse layers of a mixture-of-experts config
(``cfg.moe.is_sparse``), ``ParallelMoE`` (routed experts with EP, sigmoid-gated shared expert),
zero-centred RMSNorms; the stack with embedding and final norm is ``blocks/decoder.ParallelDecoder``
with these layers (so ``ParallelCausalLM`` drives it unchanged).

Activations are ``[seq, batch, hidden]`` (``[seq/tp, batch, hidden]`` between blocks under SP).
"""

from __future__ import annotations

from torch import nn

from models.common.blocks.decoder import ParallelDecoder
from models.common.blocks.gated_attention import ParallelGatedAttention
from models.common.blocks.gated_deltanet import ParallelGatedDeltaNet
from models.common.blocks.mlp import ParallelMLP
from models.common.blocks.moe import ParallelMoE
from models.common.blocks.norms import ZeroCenteredRMSNorm
from models.common.hybrid.config import LINEAR_ATTENTION, HybridModelConfig
from parallel.groups import ParallelGroups


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: HybridModelConfig, groups: ParallelGroups, dtype, device, layer: int) -> None:
        super().__init__()
        sp = groups.sequence_parallel
        self.linear = cfg.attention_type(layer) == LINEAR_ATTENTION
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, partial_grad=sp, dtype=dtype,
                                                   device=device)
        if self.linear:
            self.linear_attn = ParallelGatedDeltaNet(cfg, groups, dtype, device)
        else:
            self.self_attn = ParallelGatedAttention(cfg, groups, dtype, device)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, partial_grad=sp,
                                                            dtype=dtype, device=device)
        sparse = cfg.moe is not None and cfg.moe.is_sparse(layer)
        self.mlp = ParallelMoE(cfg, groups, dtype, device) if sparse else ParallelMLP(cfg, groups, dtype, device)

    def forward(self, x, cos, sin, attention_mask=None, cu_seqlens=None, max_seqlen=None, seq=None):
        mixer = self.linear_attn if self.linear else self.self_attn
        x = x + mixer(self.input_layernorm(x), cos, sin, attention_mask, cu_seqlens, max_seqlen, seq)
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridDecoder(ParallelDecoder):
    """``ParallelDecoder`` with the hybrid layers and a zero-centred final norm."""

    layer_class = HybridDecoderLayer

    @staticmethod
    def final_norm(cfg: HybridModelConfig, sp: bool, dtype, device) -> nn.Module:
        return ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, partial_grad=sp, dtype=dtype, device=device)
