"""One virtual pipeline stage of a causal LM as a module ``torch.distributed.pipelining`` can drive
(``forward_backward.py`` builds one per chunk; the plain loop uses one for the MoE router carry)."""

from __future__ import annotations

import torch
from torch import nn

from models.common.blocks.moe import carry_router_sums, recording_routes
from parallel.sequence_shard import SequenceShard


class PipelineChunk(nn.Module):
    """One virtual pipeline stage of a ParallelCausalLM: [embedding] -> layers -> [norm, head].

    Input: token ids ``[1, T]`` (first chunk) or hidden states ``[T(/tp), 1, hidden]``; output:
    hidden states, or vocab-sharded logits ``[T, 1, V/tp]`` on the last chunk. The language model is
    held in a list so its parameters are not registered twice under new names.

    With ``aux`` (mixture-of-experts load-balancing loss), a second tensor travels with the hidden
    states: the micro-batch's router statistics summed over the chunks so far
    (``models.common.blocks.moe.carry_router_sums``), each chunk adding its sparse layers' over the real
    tokens (``token_mask``). The last chunk returns ``(logits, carry)``; the loss of the carry sends
    every chunk the gradient of its own router probabilities back through the schedule.
    """

    def __init__(self, lm: nn.Module, chunk: int, aux: bool = False) -> None:
        super().__init__()
        self._lm = [lm]
        self.layer_ids = lm.chunk_layers[chunk]
        self.first = lm.is_first_stage and chunk == 0
        self.last = lm.is_last_stage and chunk == len(lm.chunk_layers) - 1
        # Registered so PipelineStage sees exactly this chunk's parameters.
        self.layers = nn.ModuleList([lm.model.layers[str(i)] for i in self.layer_ids])
        self.embed_tokens = lm.model.embed_tokens if self.first else None
        self.visual = getattr(lm, "visual", None) if self.first else None  # Qwen2-VL's tower feeds the embeddings
        self.norm = lm.model.norm if self.last else None
        self.lm_head = lm.lm_head if self.last else None
        self.aux = aux
        sparse = set(id(blk) for blk in lm.moe_blocks()) if aux else set()
        self._sparse = [layer.mlp for layer in self.layers if id(layer.mlp) in sparse]  # a plain list: no new names

    def forward(self, x: torch.Tensor, carry: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, seq: SequenceShard | None = None,
                token_mask: torch.Tensor | None = None, inputs: dict | None = None):
        lm = self._lm[0]
        h = lm.embed_microbatch(x, inputs, seq) if self.first else x
        with recording_routes(self._sparse, token_mask):
            h = lm.run_layers(h, self.layer_ids, position_ids, None, None if seq is not None else cu_seqlens, seq=seq)
            if self.aux:
                carry = carry_router_sums(carry, self._sparse, lm.groups, lm.config.moe.num_experts, h.device)
        out = self.lm_head(self.norm(h)) if self.last else h
        return (out, carry) if self.aux else out
