"""The decoder: pre-norm layers (attention + MLP or mixture of experts, chosen per layer from the
config), the stack of this rank's layers with the embedding and final norm, and what a causal LM
forward returns (``CausalLMOutput``).

Activations are ``[seq, batch, hidden]`` (``[seq/tp, batch, hidden]`` between blocks under SP).
Parameter names follow vLLM (``model.layers.{i}.self_attn.qkv_proj.weight`` ...), layers are keyed
by their global index so names do not depend on the parallel layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.common.blocks.attention import ParallelAttention
from models.common.blocks.mlp import ParallelMLP
from models.common.blocks.moe import ParallelMoE
from models.common.config import ModelConfig
from parallel.groups import ParallelGroups
from parallel.layers import RMSNorm, VocabParallelEmbedding

# The attention block of each ``ModelConfig.attention_type`` (transformers' ``layer_types``); models with
# other kinds of layers (linear attention, sliding windows) add theirs here.
ATTENTION_BLOCKS = {"full_attention": ParallelAttention}


@dataclass
class CausalLMOutput:
    """``loss``: mean over non-ignored tokens (None without labels).
    ``logits``: ``[batch, seq, V/tp]`` this rank's real vocabulary columns, or ``[batch, seq, V]``
    with ``gather_logits=True`` (packed input: batch 1, seq = total tokens).
    ``aux_loss``/``router_logits`` (mixture-of-experts models with ``output_router_logits``): the
    load-balancing loss (already added to ``loss``, times ``router_aux_loss_coef``, when labels are
    given) and each sparse layer's router logits ``[batch * seq, E]``, as transformers returns them.
    """

    loss: torch.Tensor | None
    logits: torch.Tensor | None
    aux_loss: torch.Tensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each chosen per layer from the config: the attention block by
    ``cfg.attention_type(layer)``, the MLP a mixture of experts when ``cfg.moe`` says so."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, dtype, device, layer: int = 0) -> None:
        super().__init__()
        sp = groups.sequence_parallel
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, sequence_parallel=sp, dtype=dtype,
                                       device=device)
        self.self_attn = ATTENTION_BLOCKS[cfg.attention_type(layer)](cfg, groups, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, sequence_parallel=sp, dtype=dtype,
                                                device=device)
        if cfg.moe is not None and cfg.moe.is_sparse(layer):
            self.mlp = ParallelMoE(cfg, groups, dtype, device)
        else:
            self.mlp = ParallelMLP(cfg, groups, dtype, device)

    def forward(self, x, cos, sin, attention_mask=None, cu_seqlens=None, max_seqlen=None, seq=None):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, attention_mask, cu_seqlens, max_seqlen, seq)
        # x + attn and the post-attention norm of it in one pass (a fused kernel on CUDA, parallel.fused_ops)
        h, x = self.post_attention_layernorm(attn, residual=x)
        return x + self.mlp(h)


class ParallelDecoder(nn.Module):
    """Embedding (first pipeline stage), this rank's layers keyed by global index, final norm (last stage).
    Other decoders (the Gated DeltaNet hybrids) set ``layer_class`` and ``final_norm``."""

    layer_class = DecoderLayer

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, layer_ids: list[int], padded_vocab: int, dtype,
                 device, *, has_embedding: bool = True, has_norm: bool = True):
        super().__init__()
        sp = groups.sequence_parallel
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, padded_vocab, cfg.hidden_size,
                                                   tp_group=groups.tp_group, sequence_parallel=sp, dtype=dtype,
                                                   device=device) if has_embedding else None
        self.layers = nn.ModuleDict({str(i): self.layer_class(cfg, groups, dtype, device, i) for i in layer_ids})
        self.norm = self.final_norm(cfg, sp, dtype, device) if has_norm else None

    @staticmethod
    def final_norm(cfg: ModelConfig, sp: bool, dtype, device) -> nn.Module:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, sequence_parallel=sp, dtype=dtype, device=device)
