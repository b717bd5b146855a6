"""Sequence-split forward glue (context parallel and Ulysses): the model slices its own inputs.

Every rank of a CP/Ulysses group receives the same full batch. The batch becomes packed sequences
(a padded batch loses its padding: only real tokens are computed, unlike Megatron's per-sequence
padding), each rank takes its tokens by the ``SequencePlan`` (``parallel/sequence_layout.py``),
runs the layers on them, and outputs that every caller expects whole (logits, per-token
log-probs) are gathered back into the caller's layout. Position ids and HF-shifted targets are
computed on the whole batch first and sliced the same way, so no rank needs another rank's
positions (RoPE is applied before the Ulysses all-to-all) and the last token of a chunk still
predicts the first token of the next chunk.

A model that cannot see the whole batch up front (Qwen2-VL: image features exist only after the
vision tower) slices after embedding with the same ``SequenceShard.take``.

Mixture-of-experts models with the load-balancing loss: each sparse layer records its routing for
this rank's real tokens (``shard.index >= 0``), and ``router_sums`` adds the statistics up over the
cp and Ulysses ranks, so every rank computes the loss of the whole batch (its gradient reaches each
rank's router for that rank's tokens; ``finalize_grads`` sums them over the replica group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.common.blocks.decoder import CausalLMOutput
from models.common.blocks.moe import layer_router_logits, load_balancing_loss, recording_routes
from parallel.collectives import group_size
from parallel.groups import ParallelGroups
from parallel.sequence_layout import SequencePlan
from parallel.sequence_shard import gather_tokens, plan_for, shard_of, sum_over_sequence_groups

IGNORE_INDEX = -100


@dataclass
class FlatBatch:
    """A batch as packed real tokens: ``ids/positions/targets [T]``, sequences of ``lengths``.

    ``keep`` (padded input only): the flat ``b*s`` position of each real token, to put per-token
    outputs back into the caller's ``[b, s]`` layout (``shape``). ``max_position``: over every
    position given, padding included (what transformers' dynamic-NTK RoPE scales by).
    """

    ids: torch.Tensor
    positions: torch.Tensor  # [T], or [3, T] (M-RoPE)
    targets: torch.Tensor | None
    lengths: list[int]
    shape: tuple[int, int]
    keep: torch.Tensor | None
    max_position: int = 0

    @property
    def total(self) -> int:
        return int(self.ids.numel())


def flatten_batch(input_ids: torch.Tensor, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                  labels: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> FlatBatch:
    """Packed (``cu_seqlens``) or padded (``[b, s]`` + optional mask) input -> ``FlatBatch``.

    Targets follow transformers: token t predicts label t+1 of its own row/sequence; padded rows
    keep only real tokens (mask 1), so predictions made *from* padding are not scored (as in
    ``forward_backward``); a real token's target may still be a label at a padded position.
    """
    device = input_ids.device
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError("packed input (cu_seqlens) takes no attention_mask")
        ids = input_ids.reshape(-1)
        total = ids.numel()
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        if cu[0] != 0 or cu[-1] != total or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must rise from 0 to the token count {total}, got {cu.tolist()}")
        lengths = (cu[1:] - cu[:-1]).tolist()
        starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
        if position_ids is None:
            positions = torch.arange(total, device=device) - starts
        else:  # [T] / [1, T], or M-RoPE rows [3, 1, T] -> [3, T]
            positions = position_ids.reshape(3, -1) if position_ids.dim() == 3 else position_ids.reshape(-1)
        targets = None
        if labels is not None:
            flat = labels.reshape(-1)
            targets = torch.full_like(ids, IGNORE_INDEX)
            targets[:-1] = flat[1:]
            targets[(cu[1:] - 1)[cu[1:] > cu[:-1]]] = IGNORE_INDEX
        return FlatBatch(ids, positions, targets, lengths, (1, total), None,
                         int(positions.max()) if total else 0)
    bsz, seq = input_ids.shape
    keep = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    pos = position_ids if position_ids is not None else torch.arange(seq, device=device).expand(bsz, seq)
    flat_keep = keep.reshape(-1).nonzero().reshape(-1)
    targets = None
    if labels is not None:
        shifted = torch.full_like(input_ids, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        targets = shifted.reshape(-1)[flat_keep]
    flat_pos = pos.reshape(3, -1)[:, flat_keep] if pos.dim() == 3 else pos.reshape(-1)[flat_keep]  # M-RoPE: [3, T]
    return FlatBatch(input_ids.reshape(-1)[flat_keep], flat_pos, targets,
                     keep.sum(1).tolist(), (bsz, seq), flat_keep, int(pos.max()) if pos.numel() else 0)


def unflatten(values: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
    """Per-token ``values [T, ...]`` back into the caller's layout ``[b, s, ...]`` (0 at padding)."""
    if batch.keep is None:
        return values.reshape(1, batch.total, *values.shape[1:])
    b, s = batch.shape
    out = values.new_zeros((b * s, *values.shape[1:]))
    out[batch.keep] = values
    return out.reshape(b, s, *values.shape[1:])


def _global_rope_seq_len(lm, positions: torch.Tensor, groups: ParallelGroups) -> int | None:
    """``max(position) + 1`` over every rank's tokens, for dynamic-NTK RoPE only (None otherwise)."""
    if lm.config.rope.rope_type != "dynamic":
        return None
    import torch.distributed as dist

    top = positions.max().reshape(1).to(torch.long) if positions.numel() else torch.zeros(1, dtype=torch.long)
    for group in (groups.cp_group, groups.ulysses_group):
        if group_size(group) > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return int(top) + 1


def split_sequence_forward(lm, input_ids, position_ids, attention_mask, labels, cu_seqlens, gather_logits: bool,
                           return_logits: bool, plan: SequencePlan | None, targets: torch.Tensor | None,
                           multimodal=None, router_logits: bool = False):
    """``ParallelCausalLM.forward`` when the sequence is split over cp/ulysses ranks (see module doc).

    ``multimodal`` (Qwen2-VL's vision features): merged into the embeddings of this rank's tokens
    (``lm.embed_shard``), so padding is removed before embedding and the slicing comes after the merge.

    ``router_logits`` (mixture-of-experts models): also return the load-balancing loss of the whole
    batch (added to the loss times ``router_aux_loss_coef``, as transformers does) and the router
    logits of each sparse layer, gathered like the logits into transformers' ``[batch * seq, E]``
    order. Padding tokens are never computed here, so their rows are 0 where transformers has the
    router's logits of the padding token (real tokens' rows equal transformers'); with
    ``sequence_plan`` they stay local, ``[local tokens, E]`` (plan padding rows included)."""
    groups = lm.groups
    presliced = plan is not None
    if not presliced:
        if targets is not None:
            raise ValueError("targets= is for already-sliced inputs (with sequence_plan=); pass labels= instead")
        batch = flatten_batch(input_ids, position_ids, attention_mask, labels, cu_seqlens)
        plan = plan_for(groups, batch.lengths, batch.total)
        rope_len = batch.max_position + 1 if lm.config.rope.rope_type == "dynamic" else None
        shard = shard_of(groups, plan, rope_len)
        ids = shard.take(batch.ids)
        pos = shard.take(batch.positions.t()).t() if batch.positions.dim() == 2 else shard.take(batch.positions)
        tgt = shard.take(batch.targets, IGNORE_INDEX) if batch.targets is not None else None
        count = (batch.targets != IGNORE_INDEX).sum() if batch.targets is not None else None
    else:
        if labels is not None or attention_mask is not None or cu_seqlens is not None:
            raise ValueError("with sequence_plan= pass this rank's tokens, their targets= (HF-shifted labels) and "
                             "optionally position_ids=; labels=, attention_mask= and cu_seqlens= describe a whole "
                             "batch")
        shard = shard_of(groups, plan)
        ids = input_ids.reshape(-1)
        if ids.numel() != shard.index.numel():
            raise ValueError(f"this rank takes {shard.index.numel()} tokens of the plan (plan.token_index"
                             f"{lm.sequence_coordinates}), got {ids.numel()}")
        pos = position_ids.reshape(-1) if position_ids is not None else plan.positions(shard.index).to(ids.device)
        dynamic = position_ids is None and lm.config.rope.rope_type == "dynamic"
        shard.rope_seq_len = max(plan.lengths, default=1) if dynamic else _global_rope_seq_len(lm, pos, groups)
        tgt = targets.reshape(-1) if targets is not None else None
        count = None
        if tgt is not None:
            count = sum_over_sequence_groups((tgt != IGNORE_INDEX).sum().to(torch.float64), groups).detach()
    if multimodal is not None and presliced:
        raise ValueError("multimodal inputs need the whole batch (not sequence_plan= slices)")
    blocks = lm.moe_blocks() if router_logits else []
    real = (shard.index >= 0).to(torch.float32) if blocks else None  # this rank's tokens in the layers' order
    with recording_routes(blocks, real):
        h = lm.embed_shard(ids, shard, batch if not presliced else None, multimodal)  # [n(/tp), 1, hidden]
        h = lm.run_layers(h, lm.layer_ids(), pos[:, None] if pos.dim() == 2 else pos[None], seq=shard)
        aux_loss = routers = None
        if blocks:
            aux_loss = load_balancing_loss(blocks, groups)
            local = [layer_router_logits(blk, shard.index.numel()) for blk in blocks]
            routers = tuple(rows if presliced else unflatten(gather_tokens(rows, shard), batch).flatten(0, 1)
                            for rows in local)
    h = lm.model.norm(h)
    logits = lm.lm_head(h) if return_logits else None  # [n, 1, V_pad/tp]; without: the fused, chunked head
    loss = None
    if tgt is not None:
        per_token = lm.token_losses(logits, tgt[:, None]) if return_logits else lm.head_losses(h, tgt[:, None])
        local_sum = per_token.sum()
        loss = sum_over_sequence_groups(local_sum, groups) / count.clamp(min=1).to(local_sum.dtype)
        if aux_loss is not None:
            loss = loss + lm.config.moe.router_aux_loss_coef * aux_loss
    out_logits = None
    if return_logits:
        from parallel.collectives import gather_last_dim

        local = logits[:, 0]
        if gather_logits:
            local = gather_last_dim(local, groups.tp_group)[..., : lm.config.vocab_size]
        else:
            local = local[..., : lm.lm_head.valid_columns]
        out_logits = local[None] if presliced else unflatten(gather_tokens(local, shard), batch)
    return CausalLMOutput(loss=loss, logits=out_logits, aux_loss=aux_loss, router_logits=routers)
