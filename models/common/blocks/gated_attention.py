"""The gated full-attention block of the Gated DeltaNet hybrids (Qwen3.5's ``full_attention`` layers),
tensor- and sequence-parallel.

``q_proj`` has ``2 * heads * head_dim`` rows: per head, its query then its output gate (transformers
views them as ``[heads, 2 * head_dim]`` and cuts each row in half), so a contiguous split by heads
keeps each gate with its query; it is packed with k/v as ``qkv_proj`` (``QKVParallelLinear`` over
``2 * heads`` "heads", KV heads split or replicated as in the dense attention). q/k are normalised by
zero-centred RMSNorms over ``head_dim``, RoPE rotates their first ``rotary_dim`` channels (partial
rotary), causal attention as the dense block's (``blocks/attention.causal_attention``), then
``out * sigmoid(gate)`` and ``o_proj`` (row-parallel).
"""

from __future__ import annotations

from torch import nn

from models.common.blocks.attention import ParallelAttention, causal_attention
from models.common.blocks.norms import ZeroCenteredRMSNorm
from models.common.hybrid.config import HybridModelConfig
from parallel.fused_ops import apply_rotary
from parallel.groups import ParallelGroups
from parallel.layers import QKVParallelLinear, RowParallelLinear


class ParallelGatedAttention(nn.Module):
    def __init__(self, cfg: HybridModelConfig, groups: ParallelGroups, dtype, device) -> None:
        super().__init__()
        sp = groups.sequence_parallel
        self.head_dim = cfg.head_dim
        self.gated = cfg.attn_output_gate
        q_heads = (2 if self.gated else 1) * cfg.num_attention_heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, q_heads, cfg.num_key_value_heads, bias=False,
                                          tp_group=groups.tp_group, sequence_parallel=sp, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False,
                                        tp_group=groups.tp_group, sequence_parallel=sp, dtype=dtype, device=device)
        partial = groups.tp_size > 1  # each rank normalises only its heads: gradients summed over TP
        self.q_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps, partial_grad=partial, dtype=dtype,
                                          device=device)
        self.k_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps, partial_grad=partial, dtype=dtype,
                                          device=device)

    def forward(self, x, cos, sin, attention_mask=None, cu_seqlens=None, max_seqlen=None, seq=None):
        qkv = self.qkv_proj(x)  # [s, b, (2 hq + 2 hkv) * d]
        s, b, _ = qkv.shape
        q_size, kv_size, _ = self.qkv_proj.local_sizes()
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        d = self.head_dim
        gate = None
        if self.gated:
            q, gate = q.reshape(s, b, -1, 2 * d).split([d, d], dim=-1)  # per head: query, then its gate
            gate = gate.reshape(s, b, -1)
        q = self.q_norm(q.reshape(s, b, -1, d))
        k = self.k_norm(k.reshape(s, b, -1, d))
        v = v.reshape(s, b, -1, d)
        q, k = apply_rotary(q, k, cos, sin)  # the first cos.shape[-1] channels rotate
        if seq is None:
            out = causal_attention(q, k, v, attention_mask=attention_mask, cu_seqlens=cu_seqlens,
                                   max_seqlen=max_seqlen)
        else:  # cp/ulysses: the dense block's split attention (Ulysses all-to-all, ring or all-gather)
            out = ParallelAttention._split_sequence_attention(q, k, v, seq)
        if gate is not None:
            out = out * gate.sigmoid()
        return self.o_proj(out)
