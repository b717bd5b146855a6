"""One training (or log-prob) step over micro-batches, with or without pipeline parallelism.

``forward_backward`` takes the whole per-DP-rank batch (padded ``[b, s]`` with an optional
attention mask, or packed tokens with ``cu_seqlens``), turns it into samples with HF-shifted
targets, splits them into balanced packed micro-batches, runs them (a plain loop at pp=1, a
``torch.distributed.pipelining`` schedule at pp>1), and finalizes gradients. The loss is the token
mean over every non-ignored target of the *global* batch (all micro-batches and DP ranks), the
exact number transformers computes for the concatenated batch: each micro-batch contributes
``sum of its token losses / global token count``, and DP gradients are summed, not averaged.

With context/Ulysses parallelism every micro-batch is laid out over the cp/ulysses ranks
(``SequencePlan``) after packing: each rank runs its tokens, the token losses of all ranks add up
to the micro-batch's, and gradients are summed over those ranks like over DP. The load-balancing
loss of a micro-batch is computed whole on each of its ranks (router statistics summed over them,
``router_sums``); its gradient reaches each rank's router for that rank's tokens.

The LM head runs fused with the loss in chunks of tokens (``lm.head_losses``,
``parallel/lm_head_loss.py``): the last stage's output is the final-norm hidden states and the
loss function applies the head, so no micro-batch's full logits ever exist; forward-only passes
return per-token losses (log-probs) and, when asked, entropies the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from models.common.blocks.moe import balance_loss, split_carry
from models.common.training.microbatches import IGNORE_INDEX, merge_sample_inputs, pack, to_samples
from models.common.training.pipeline_chunk import PipelineChunk
from parallel.grads import finalize_grads
from parallel.microbatch import plan_microbatches
from parallel.pipeline import PipelineRunner, check_schedule, microbatch_minimum, microbatch_multiple, resolve_schedule
from parallel.sequence_shard import SequenceShard, gather_tokens, plan_for, shard_of


def forward_backward(lm, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, num_microbatches: int = 1,
                     schedule: str = "1f1b", forward_only: bool = False, cu_seqlens: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                     max_tokens_per_microbatch: int | None = None, aux_loss: bool | None = None,
                     return_aux_loss: bool = False, return_entropy: bool = False, sample_inputs=None):
    """See ``ParallelCausalLM.forward_backward``. ``sample_inputs``: called with the samples' token ids
    (each row without padding, or each packed segment), it returns each sample's model inputs, which
    the first stage gets merged per micro-batch (Qwen2-VL's pixels and grids)."""
    groups = lm.groups
    if return_entropy and not forward_only:
        raise ValueError("return_entropy=True needs forward_only=True (the entropy is a forward-only output)")
    aux = lm._wants_router_logits(aux_loss) and not forward_only
    pp, vpp, tp = groups.pp_size, groups.config.vpp, groups.tp_size
    schedule = resolve_schedule(schedule, vpp)
    if pp > 1:  # name and vpp; the planner below makes the count a multiple of what the schedule needs
        check_schedule(schedule, vpp, microbatch_multiple(schedule, pp), pp)
    # Micro-batches are planned and packed on the host (lengths, sorting, small index tensors), then
    # each packed micro-batch goes to the parameters' device; collectives use that device too (NCCL
    # takes CUDA tensors only).
    device, in_device = next(lm.parameters()).device, input_ids.device
    input_ids, labels, attention_mask, cu_seqlens, position_ids = (
        None if t is None else t.cpu() for t in (input_ids, labels, attention_mask, cu_seqlens, position_ids))
    samples = to_samples(input_ids, labels, attention_mask, cu_seqlens, position_ids)
    if sample_inputs is not None:
        for sample, inputs in zip(samples, sample_inputs([sample.ids for sample in samples]), strict=True):
            sample.inputs = inputs
    if pp > 1:  # the loss is the same for any split, so the count may rise to what the schedule needs
        # (torch's 1F1B runs at least one micro-batch per stage: a batch needs >= pp samples then)
        num_microbatches = max(num_microbatches, microbatch_minimum(schedule, pp))
    plan = plan_microbatches([len(s.ids) for s in samples], max_tokens_per_microbatch=max_tokens_per_microbatch,
                             num_microbatches=num_microbatches,
                             multiple_of=microbatch_multiple(schedule, pp) if pp > 1 else 1)
    # One packed shape for every micro-batch (pipeline buffers are fixed); a multiple of tp under SP.
    total = max(plan.tokens)
    if groups.sequence_parallel:
        total = -(-total // tp) * tp
    mbs = [pack([samples[i] for i in group], total) for group in plan.groups]
    # Per-sample model inputs (Qwen2-VL's pixels and grids), merged per micro-batch for its first stage.
    mb_inputs = [merge_sample_inputs([samples[i].inputs for i in group]) for group in plan.groups]
    shards: list[SequenceShard | None] = [None] * len(mbs)
    if groups.sequence_split:  # each micro-batch laid out over the cp/ulysses ranks: keep this rank's tokens
        for m, group in enumerate(plan.groups):
            ids, pos, tgt, cu = mbs[m]
            rope_len = int(pos.max()) + 1 if lm.config.rope.rope_type == "dynamic" else None
            shard = shard_of(groups, plan_for(groups, [len(samples[i].ids) for i in group], total), rope_len)
            shards[m] = shard
            local_pos = shard.take(pos[:, 0].t()).t()[:, None] if pos.dim() == 3 else shard.take(pos[0])[None]
            mbs[m] = (shard.take(ids[0])[None], local_pos, shard.take(tgt[0], IGNORE_INDEX)[None], cu)
            if mb_inputs[m] is not None:  # multimodal features are placed by global token: keep the whole ids
                mb_inputs[m]["packed_ids"] = ids.to(device)
    mbs = [tuple(t.to(device) for t in mb) for mb in mbs]
    local_count = sum(int((s.targets != IGNORE_INDEX).sum()) for s in samples)
    count = torch.tensor([local_count, len(mbs)], dtype=torch.float64, device=device)
    if groups.dp_group is not None:
        dist.all_reduce(count, group=groups.dp_group)
    global_count, global_mbs = max(float(count[0]), 1.0), float(count[1])
    # The load-balancing loss is transformers' per micro-batch (all its layers and real tokens), averaged
    # over the micro-batches of all DP ranks: exactly transformers' for one micro-batch and one replica.
    # Under cp/ulysses each rank records its real tokens (``router_sums`` adds the ranks' statistics up).
    if not aux:
        token_masks = [None] * len(mbs)
    elif groups.sequence_split:
        token_masks = [(shard.index >= 0).to(device=device, dtype=torch.float32) for shard in shards]
    else:
        token_masks = [(torch.arange(total, device=device) < sum(len(samples[i].ids) for i in group))
                       .to(torch.float32) for group in plan.groups]

    aux_scale = lm.config.moe.router_aux_loss_coef / global_mbs if aux else 0.0

    if groups.config.fsdp:
        from parallel.fsdp import set_replica_scale

        set_replica_scale(lm, None)  # losses are already over the global token count: sum
    if pp == 1:
        loss_fn = _TokenLoss(lm)
        loss_fn.reset(forward_only, global_count, aux_scale, return_entropy)
        outputs = []
        chunk = loss_chunk(lm, 0, aux) if aux else None
        for (ids, pos, tgt, cu), shard, token_mask, inputs in zip(mbs, shards, token_masks, mb_inputs):
            with torch.set_grad_enabled(not forward_only):
                if chunk is not None:
                    out = loss_fn(chunk(ids, position_ids=pos, cu_seqlens=cu, seq=shard, token_mask=token_mask,
                                        inputs=inputs), tgt)
                else:  # one FSDP2 forward method from the ids to the fused head's token losses
                    out = loss_fn.reduce(lm.packed_losses(ids, pos, cu, shard, inputs, tgt.t(), return_entropy))
            if not forward_only:
                out.backward()
                out = out.detach()
            outputs.append(out)
    else:
        runner = _runner(lm, schedule, len(mbs), total, aux)
        loss_fn = runner.loss_fn
        loss_fn.reset(forward_only, global_count, aux_scale, return_entropy)
        kwarg_mbs = [{"position_ids": pos, "cu_seqlens": cu, "seq": shard}
                     for (_, pos, _, cu), shard in zip(mbs, shards)]
        if aux:
            for kwargs, token_mask in zip(kwarg_mbs, token_masks):
                kwargs["token_mask"] = token_mask
        for kwargs, inputs in zip(kwarg_mbs, mb_inputs):
            if inputs is not None and lm.is_first_stage:
                kwargs["inputs"] = inputs
        outputs = runner.run(
            arg_mbs=[(ids,) if lm.is_first_stage else () for ids, _, _, _ in mbs], kwarg_mbs=kwarg_mbs,
            target_mbs=[tgt for _, _, tgt, _ in mbs] if lm.is_last_stage else None,
            has_backward=not forward_only)
    if forward_only:
        if groups.sequence_split and lm.is_last_stage:  # every rank's token losses, in packed order
            outputs = [gather_tokens(o, shard) for o, shard in zip(outputs, shards)]
        values = _per_token(lm, outputs, plan, samples, input_ids, attention_mask, cu_seqlens, total,
                            2 if return_entropy else 1)
        logprobs = -values[0]
        if not return_entropy:
            return logprobs.to(in_device)
        entropy = values[1] if attention_mask is None else values[1] * attention_mask.to(values.dtype)  # 0 at pads
        return logprobs.to(in_device), entropy.to(in_device)
    if lm.is_last_stage:  # [loss, sum of this rank's micro-batch aux losses]
        aux_values = loss_fn.aux_values[-len(mbs):] if aux else []
        ce = torch.stack(outputs).sum().float()
        aux_sum = torch.stack(aux_values).sum().float().to(ce.device) if aux_values else ce.new_zeros(())
        if aux_values and groups.sequence_split:
            # every cp/ulysses rank of a micro-batch holds its whole aux loss: count it once in the sum below
            share = 1.0 / (groups.cp_size * groups.ulysses_size)
            ce = ce - (1.0 - share) * aux_scale * aux_sum
            aux_sum = aux_sum * share
        totals = torch.stack([ce, aux_sum])
    else:
        totals = torch.zeros(2, dtype=torch.float32, device=device)
    totals = _from_last_stage(lm, totals.to(device))
    if groups.replica_group is not None:  # dp ranks' batches and cp/ulysses ranks' tokens add up
        dist.all_reduce(totals, group=groups.replica_group)
    finalize_pipeline_grads(lm)
    loss = totals[0]
    if return_aux_loss:
        return loss, totals[1] / global_mbs if aux else None
    return loss


class _HeadInLoss(nn.Module):
    """Takes the LM head's place in the last pipeline chunk: passes the final-norm hidden states on, and
    ``_TokenLoss`` applies the head fused with the loss. The head stays a child, so the chunk still
    owns its weight (the zero-bubble schedules compute weight gradients of the chunk's parameters)."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h


def loss_chunk(lm, chunk: int, aux: bool = False) -> PipelineChunk:
    """``PipelineChunk(lm, chunk, aux)`` whose last chunk outputs final-norm hidden states ``[T(/tp), 1,
    hidden]`` instead of logits (the loss function runs the fused, chunked head). A model whose stages
    pass more than hidden states along names its chunk class (``pipeline_chunk_class``: Qwen3-VL's DeepStack)."""
    module = getattr(lm, "pipeline_chunk_class", PipelineChunk)(lm, chunk, aux)
    if module.last:
        module.lm_head = _HeadInLoss(module.lm_head)
    return module


class _TokenLoss:
    """The schedule's loss function on the last chunk's hidden states: the fused head's summed token
    losses over the global token count (training), or the per-token losses themselves ``[T, 1]``
    (forward-only; ``[T, 2]`` with the entropy); with a router carry (``PipelineChunk(aux=True)``)
    plus ``aux_scale`` times the micro-batch's load-balancing loss. Mutable so a cached schedule
    serves every step."""

    def __init__(self, lm) -> None:
        self.lm = lm
        self.reset(False, 1.0, 0.0)

    def reset(self, forward_only: bool, global_count: float, aux_scale: float, entropy: bool = False) -> None:
        self.forward_only, self.global_count, self.aux_scale = forward_only, global_count, aux_scale
        self.entropy = entropy and forward_only
        self.aux_values: list[torch.Tensor] = []  # per micro-batch, in schedule order

    def __call__(self, output, target: torch.Tensor) -> torch.Tensor:
        hidden, carry = output if isinstance(output, tuple) else (output, None)
        # hidden [T(/tp), 1, H], target [1, T]
        return self.reduce(self.lm.head_losses(hidden, target.t(), self.entropy), carry)

    def reduce(self, per_token, carry: torch.Tensor | None = None) -> torch.Tensor:
        """The loss (or forward-only output) of one micro-batch's per-token losses (``(loss, entropy)``)."""
        if self.forward_only:
            columns = per_token if isinstance(per_token, tuple) else (per_token,)
            return torch.stack([c.detach().reshape(-1) for c in columns], dim=1)
        loss = per_token.sum() / self.global_count
        if carry is not None:
            aux = balance_loss(*split_carry(carry))
            self.aux_values.append(aux.detach())
            loss = loss + self.aux_scale * aux
        return loss


_RUNNERS_KEPT = 4


def _runner(lm, schedule: str, n_microbatches: int, total_tokens: int, aux: bool = False) -> PipelineRunner:
    """The cached PipelineRunner for this shape (a few shapes kept, oldest dropped)."""
    cache = lm.__dict__.setdefault("_pipeline_runners", {})
    key = (schedule, n_microbatches, total_tokens, aux)
    if key not in cache:
        groups = lm.groups
        pp, vpp = groups.pp_size, groups.config.vpp
        if len(cache) >= _RUNNERS_KEPT:
            cache.pop(next(iter(cache)))
        cache[key] = PipelineRunner(
            [loss_chunk(lm, v, aux) for v in range(vpp)],
            stage_indices=[v * pp + groups.pp_rank for v in range(vpp)],
            num_stages=pp * vpp, pp_group=groups.pp_group, device=next(lm.parameters()).device, schedule=schedule,
            n_microbatches=n_microbatches, loss_fn=_TokenLoss(lm))
    return cache[key]


def _from_last_stage(lm, tensor: torch.Tensor) -> torch.Tensor:
    """Broadcast a tensor (same shape on every rank) from the last pipeline stage to all stages."""
    groups = lm.groups
    if groups.pp_size == 1:
        return tensor
    tensor = tensor.contiguous()
    dist.broadcast(tensor, src=dist.get_global_rank(groups.pp_group, groups.pp_size - 1), group=groups.pp_group)
    return tensor


def finalize_pipeline_grads(lm) -> None:
    """TP reductions, tied embedding/head copies summed across stages, DP gradients summed."""
    groups = lm.groups
    params = [p for p in lm.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    finalize_grads(params, tp_group=groups.tp_group, replica_group=groups.replica_group,
                   replicas_reduced=groups.config.fsdp, expert_replica_group=groups.edp_group)
    if lm.config.tie_word_embeddings and groups.pp_size > 1 and _tied_pair_trains(lm):
        if lm.is_first_stage:
            grad = lm.model.embed_tokens.weight.grad
        elif lm.is_last_stage:
            grad = lm.lm_head.weight.grad
        else:
            grad = torch.zeros(lm.padded_vocab_size // groups.tp_size, lm.config.hidden_size,
                               dtype=next(lm.parameters()).dtype)
        dist.all_reduce(grad, group=groups.pp_group)


def _tied_pair_trains(lm) -> bool:
    """Whether the tied embedding/head copies take gradients (not when frozen, e.g. under LoRA),
    agreed over the PP group: the middle stages hold neither copy and cannot tell by themselves."""
    groups = lm.groups
    owner = lm.model.embed_tokens if lm.is_first_stage else lm.lm_head if lm.is_last_stage else None
    frozen = torch.tensor([1.0 if owner is not None and not owner.weight.requires_grad else 0.0])
    dist.all_reduce(frozen, op=dist.ReduceOp.MAX, group=groups.pp_group)
    return frozen.item() == 0.0


def _per_token(lm, outputs, plan, samples, input_ids, attention_mask, cu_seqlens, total, k: int) -> torch.Tensor:
    """The forward-only outputs (``[T, k]`` per micro-batch: token losses, entropies) laid out like
    ``input_ids``, ``[k, *input_ids.shape]``, on every rank.

    ``out[:, ..., t]`` = the values of the prediction of token t (made at token t-1); 0 at first
    tokens and padding (the token losses are also 0 at ignored labels).
    """
    n_mb = plan.count
    if lm.is_last_stage:
        stacked = torch.stack([o.reshape(total, k) for o in outputs]).float()  # [n_mb, total, k]
    else:
        stacked = torch.zeros(n_mb, total, k, dtype=torch.float32, device=next(lm.parameters()).device)
    stacked = _from_last_stage(lm, stacked).cpu()  # laid out like the (host copies of the) inputs below
    return torch.stack([_layout(stacked[..., j], plan, samples, input_ids, attention_mask, cu_seqlens)
                        for j in range(k)])


def _layout(stacked: torch.Tensor, plan, samples, input_ids, attention_mask, cu_seqlens) -> torch.Tensor:
    """Per-micro-batch token values ``[n_mb, total]`` (packed order) -> ``input_ids``' layout, shifted
    by one: ``out[..., t]`` = the value computed at token t-1 of the same sequence."""
    per_mb = []
    for m, group in enumerate(plan.groups):
        offset, res = 0, []
        for i in group:
            n = len(samples[i].ids)
            res.append(stacked[m, offset:offset + n])
            offset += n
        per_mb.append(res)
    per_sample = plan.restore_order(per_mb)  # per token t: the value of its target (= label t+1)
    if cu_seqlens is not None:
        out = torch.zeros(input_ids.numel(), dtype=torch.float32)
        for (a, b), lp in zip(zip(cu_seqlens.tolist()[:-1], cu_seqlens.tolist()[1:]), per_sample):
            out[a + 1:b] = lp[:-1]
        return out.reshape(input_ids.shape)
    bsz, seq = input_ids.shape
    out = torch.zeros(bsz, seq, dtype=torch.float32)
    for r, lp in enumerate(per_sample):
        keep = attention_mask[r].bool() if attention_mask is not None else torch.ones(seq, dtype=torch.bool)
        row = torch.zeros(seq, dtype=torch.float32)
        row[keep] = lp
        out[r, 1:] = row[:-1]
    return out
