"""Qwen2-MoE's sparse MLP block with expert parallelism, and transformers' load-balancing loss.

Layout over ranks (``ParallelConfig(tp, ep, sequence_parallel)``):
  * router (``gate``) and shared-expert gate: whole on every rank;
  * shared expert: a tensor-parallel SwiGLU MLP like the dense one (column/row over TP);
  * routed experts: split over the EP group (carved from the data-parallel ranks, see
    ``parallel/groups.py``), whole on every TP rank. The TP ranks of a slot share the layer's
    tokens out: under SP each already holds ``seq/tp`` of them; without SP the replicated tokens
    are cut into tp shares, each TP rank routes and dispatches its share, and the outputs are
    all-gathered back. So expert work is never repeated over TP.

Gradient bookkeeping (``parallel/grads.py``): router and experts see only this rank's token share,
so their gradients are partial sums over TP (tagged ``sequence_parallel``); experts are held by
one rank of each EP group, so with ep > 1 they are reduced over the expert-data-parallel group
(tagged ``expert_parallel``) instead of all replicas.

The load-balancing loss is transformers' ``load_balancing_loss_func``: over all sparse layers,
``E * sum_e (assignments to e / rows) * (router probability mass of e / rows)``, where rows and
assignments count non-padding tokens of every sparse layer together. Each block keeps references to its
router outputs of the current forward (``AuxStats``); the causal LM sums them over its
layers, the TP token shares and, when the sequence is split, the cp and Ulysses ranks' tokens
(``router_sums``), so every rank computes the loss of the whole batch.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.common.blocks.mlp import ParallelMLP
from models.common.config import ModelConfig
from parallel.collectives import gather_for_replicas, group_size, reduce_from_group, scatter_to_sequence
from parallel.experts import choose_kernel, dispatch, route
from parallel.groups import ParallelGroups


@dataclass
class AuxStats:
    """What one sparse layer's router produced in this forward, for this rank's token share.

    Only references to tensors the forward computes anyway: recording them adds no operation, so a
    layer rerun by activation recomputation (which records nothing) repeats the same operations.
    """

    experts: torch.Tensor  # [T_local, k] chosen experts
    probs: torch.Tensor  # [T_local, E] fp32 router probabilities (differentiable)
    logits: torch.Tensor  # [T_local, E] router logits
    mask: torch.Tensor  # [T_local] fp32, 1 = real token (not padding)


class _Weight(nn.Module):
    """A bare ``weight`` parameter (HF names the router ``mlp.gate.weight``, the gate ``shared_expert_gate.weight``)."""

    def __init__(self, rows: int, cols: int, dtype, device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device))


class LocalExperts(nn.Module):
    """This EP rank's experts: ``w13_weight [E/ep, 2I, H]`` (``[gate | up]``), ``w2_weight [E/ep, H, I]``."""

    def __init__(self, num_local: int, hidden: int, inter: int, dtype, device) -> None:
        super().__init__()
        self.w13_weight = nn.Parameter(torch.empty(num_local, 2 * inter, hidden, dtype=dtype, device=device))
        self.w2_weight = nn.Parameter(torch.empty(num_local, hidden, inter, dtype=dtype, device=device))


class ParallelMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, dtype, device) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.moe = moe
        self.groups = groups
        self.num_experts = moe.num_experts
        self.dispatch = dispatch(groups.config.moe_dispatcher)
        self.experts_kernel: str | None = None  # "grouped" / "loop"; None: parallel.experts.choose_kernel decides
        self.gate = _Weight(moe.num_experts, cfg.hidden_size, dtype, device)
        self.experts = LocalExperts(moe.num_experts // groups.ep_size, cfg.hidden_size, moe.moe_intermediate_size,
                                    dtype, device)
        self.shared_expert = self.shared_expert_gate = None  # moe.shared_expert False: none at all (Qwen3-MoE)
        if moe.shared_expert:
            self.shared_expert = ParallelMLP(cfg, groups, dtype, device,
                                             intermediate_size=moe.shared_expert_intermediate_size)
            self.shared_expert_gate = _Weight(1, cfg.hidden_size, dtype, device)
            if groups.sequence_parallel:
                self.shared_expert_gate.weight.sequence_parallel = True
        tp_split = groups.tp_size > 1
        for p in (self.gate.weight, self.experts.w13_weight, self.experts.w2_weight):
            p.sequence_parallel = tp_split  # each TP rank routed only its share of the tokens
        if groups.ep_size > 1:
            for p in self.experts.parameters():
                p.expert_parallel = True
        # Set by the causal LM around a forward that wants the load-balancing loss:
        self.token_mask: torch.Tensor | None = None  # [tokens of the layer input] 1 = real token (s-major)
        self.stats: AuxStats | None = None

    def _token_share(self, tokens: torch.Tensor) -> torch.Tensor:
        """Without SP, this TP rank's share of the replicated tokens (padded to a multiple of tp)."""
        tp = self.groups.tp_size
        if tp == 1 or self.groups.sequence_parallel:
            return tokens
        pad = (-tokens.shape[0]) % tp
        return scatter_to_sequence(F.pad(tokens, (0, 0, 0, pad)), self.groups.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(-1, h)
        share = self._token_share(tokens)
        logits = F.linear(share, self.gate.weight)
        weights, experts, probs = route(logits, self.moe.top_k, self.moe.norm_topk_prob)
        run = _eagerly if torch.compiler.is_compiling() and self._dispatch_eagerly(share) else _call
        routed = run(self.dispatch, share, experts, weights, self.experts.w13_weight, self.experts.w2_weight,
                     self.num_experts, self.groups.ep_group, kernel=self.experts_kernel)
        if share is not tokens:
            routed = gather_for_replicas(routed, self.groups.tp_group)[: tokens.shape[0]]
        if self.token_mask is not None:
            self.stats = AuxStats(experts, probs, logits, self._mask_share(self.token_mask).to(probs.device))
        out = routed
        if self.shared_expert is not None and self.moe.shared_expert_intermediate_size:
            shared = self.shared_expert(x) * torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
            out = out + shared.reshape(-1, h)
        return out.view(s, b, h)

    def _dispatch_eagerly(self, share: torch.Tensor) -> bool:
        """Under ``torch.compile`` (``compile=True``) the dispatch runs eagerly where its shapes depend on the
        routing: the per-expert loop (row counts on the host) and expert parallelism (all-to-all splits).
        Dynamo would specialise the layer on every count vector it meets and recompile (measured: 160 s
        for one step of a 4-layer Qwen3.5-MoE on CPU, then eager once its recompile limit is hit); the grouped
        kernel at ep=1 keeps the counts on the device and stays in the graph."""
        kernel = choose_kernel(share, self.experts.w13_weight, self.experts.w2_weight, self.experts_kernel)
        return self.groups.ep_size > 1 or kernel == "loop"

    def _mask_share(self, mask: torch.Tensor) -> torch.Tensor:
        """The token mask cut like the tokens (this TP rank's share)."""
        tp = self.groups.tp_size
        if tp > 1:
            mask = F.pad(mask, (0, (-mask.shape[0]) % tp)).chunk(tp)[self.groups.tp_rank]
        return mask.to(torch.float32)


def _call(fn, *args, **kwargs):
    return fn(*args, **kwargs)


@torch.compiler.disable(reason="routing-dependent shapes: see ParallelMoE._dispatch_eagerly")
def _eagerly(fn, *args, **kwargs):
    return fn(*args, **kwargs)


@contextmanager
def recording_routes(blocks: list[ParallelMoE], token_mask: torch.Tensor | None):
    """While inside, ``blocks`` record their routing (``stats``) for the tokens of ``token_mask``
    (1 = real token, in the layers' token order); afterwards both are cleared, so a later rerun
    (activation recomputation in backward) records nothing."""
    for blk in blocks:
        blk.token_mask = token_mask
    try:
        yield
    finally:
        for blk in blocks:
            blk.token_mask = blk.stats = None


def router_sums(blocks: list[ParallelMoE], groups: ParallelGroups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The statistics of transformers' load-balancing loss over ``blocks`` (sparse layers that recorded
    ``stats`` in this forward), summed over real tokens, those layers and the ranks holding other
    tokens of the same batch: the TP token shares, and the cp and Ulysses ranks of a split sequence.

    Returns ``(assignments [E], probability [E], rows [])``: top-k assignments per expert and the
    row count (plain numbers, no gradient), and the router probability mass per expert
    (differentiable; summed with an all-reduce whose backward is the identity, so each rank's
    router gets the gradient of its own tokens and ``finalize_grads``' sums over TP (router tagged
    ``sequence_parallel``) and over the replica group (cp/ulysses ranks) complete it). Sums add
    up over layers, so pipeline stages can each contribute theirs.
    """
    stats = [blk.stats for blk in blocks]
    if any(st is None for st in stats):
        raise RuntimeError("load_balancing_loss: a sparse layer recorded no routing statistics in this forward")
    num_experts = blocks[0].num_experts
    like = stats[0].probs  # fp32, on the model's device
    assignments, probability, rows = like.new_zeros(num_experts), like.new_zeros(num_experts), like.new_zeros(())
    for st in stats:  # masked sums over this rank's tokens, all sparse layers together
        weight = st.mask[:, None]
        with torch.no_grad():
            assignments = assignments + torch.zeros_like(st.probs).scatter_add_(
                1, st.experts, weight.expand_as(st.experts).contiguous()).sum(0)
            rows = rows + st.mask.sum()
        probability = probability + (st.probs * weight).sum(0)
    for group in (groups.tp_group, groups.cp_group, groups.ulysses_group):  # ranks holding other tokens
        if group_size(group) > 1:
            packed = torch.cat([assignments, rows[None]])
            torch.distributed.all_reduce(packed, group=group)
            assignments, rows = packed[:-1], packed[-1]
            probability = reduce_from_group(probability, group)  # bwd: each share's own gradient
    return assignments, probability, rows


def balance_loss(assignments: torch.Tensor, probability: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``E * sum_e (assignments_e / rows) * (probability_e / rows)``: transformers' ``load_balancing_loss_func``
    from the sums of ``router_sums`` (gradient through ``probability`` only, as there)."""
    rows = rows.detach().clamp(min=1.0)
    return assignments.shape[0] * torch.sum((assignments.detach() / rows) * (probability / rows))


def load_balancing_loss(blocks: list[ParallelMoE], groups: ParallelGroups) -> torch.Tensor:
    """transformers' aux loss over ``blocks`` (every sparse layer of the model on this rank), over the
    tokens of every TP share and cp/ulysses rank (``router_sums``); call after a forward in which the
    blocks recorded ``stats``."""
    return balance_loss(*router_sums(blocks, groups))


def carry_router_sums(carry: torch.Tensor | None, blocks: list[ParallelMoE], groups: ParallelGroups,
                      num_experts: int, device: torch.device | None = None) -> torch.Tensor:
    """``carry`` (``[assignments | probability | rows]``, ``2E + 1`` fp32; ``None`` = zeros) plus the
    ``router_sums`` of ``blocks``: how pipeline stages pass one micro-batch's load-balancing
    statistics along with its hidden states. The probability part stays differentiable, so the
    last stage's ``balance_loss`` of the carry sends each stage the gradient of its own layers."""
    if carry is None:  # on the model's device (a stage without sparse layers sends it as it is)
        carry = torch.zeros(2 * num_experts + 1, dtype=torch.float32, device=device)
    if not blocks:
        return carry
    assignments, probability, rows = router_sums(blocks, groups)
    return carry + torch.cat([assignments, probability, rows[None]])


def split_carry(carry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(assignments, probability, rows)`` of a ``carry_router_sums`` tensor."""
    num_experts = (carry.shape[0] - 1) // 2
    return carry[:num_experts], carry[num_experts:2 * num_experts], carry[2 * num_experts]


def layer_router_logits(block: ParallelMoE, tokens: int) -> torch.Tensor:
    """A block's router logits for every row of its layer input, ``[tokens, E]`` (gathered over the TP
    token shares; ``tokens``: rows of the layer input, in the layers' order)."""
    logits = block.stats.logits
    groups = block.groups
    if groups.tp_size > 1:
        logits = gather_for_replicas(logits, groups.tp_group)
    return logits[:tokens]


def full_router_logits(block: ParallelMoE, tokens: int, batch: int, seq_len: int) -> torch.Tensor:
    """A block's router logits for the whole batch, ``[batch * seq_len, E]`` in transformers' (batch-major) order.

    ``tokens``: rows of the layer input (``s_padded * batch``, s-major)."""
    logits = layer_router_logits(block, tokens)
    logits = logits.view(-1, batch, logits.shape[-1])[:seq_len]
    return logits.transpose(0, 1).reshape(batch * seq_len, -1)
