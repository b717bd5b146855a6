"""Where megatron-core keeps a mixture-of-experts layer's experts in a legacy rank file: the three
expert modules it writes, as pure key and shape rules (torch only inside the tensor helpers).

The weight map names every expert as ``SequentialMLP`` does (``...mlp.experts.local_experts.{i}.
linear_fc{1,2}.weight``, one tensor per local expert and TP rank: fc1 ``[gate_r; up_r]``
``[2F/tp, H]``, fc2 ``[H, F/tp]``); the other layouts hold the same shards elsewhere:

  sequential    ``SequentialMLP`` (local spec, ``moe_grouped_gemm=False``): the names above
  grouped_gemm  ``GroupedMLP`` (local spec, ``moe_grouped_gemm=True``): two tensors per layer,
                ``mlp.experts.weight1`` ``[H, E_local*2F/tp]`` and ``weight2`` ``[E_local*F/tp, H]``.
                megatron-core 0.16 runs them as ``weight1.view(E_local, H, 2F/tp)`` and
                ``weight2.view(E_local, F/tp, H)`` -- a reinterpretation of the memory, not column
                blocks -- and block i is the *transpose* of local expert i's SequentialMLP shard
                (the GLU chunks the 2F/tp columns into gate, then up). No expert ``_extra_state``.
  te_grouped    Transformer Engine's ``TEGroupedMLP`` (TE spec, ``moe_grouped_gemm=True``): one
                tensor per local expert under ``mlp.experts.linear_fc{1,2}.weight{i}``, each laid
                out as SequentialMLP's; ``_extra_state`` for ``linear_fc1`` and ``linear_fc2``.

torch_dist stores all three alike (``...mlp.experts.experts.linear_fc{1,2}.weight`` ``[L, E, ...]``,
whole experts: ``converters/formats/megatron_moe``), so only legacy files need these rules.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import torch

SEQUENTIAL = "sequential"
GROUPED_GEMM = "grouped_gemm"
TE_GROUPED = "te_grouped"
_LOCAL = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
_TE = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight\d+$")


def layout_of_keys(keys: Iterable[str], args: Any) -> str:
    """The expert layout of a legacy rank file: from its keys when it holds experts, else from the args
    (``moe_grouped_gemm``, ``transformer_impl``) as Megatron-LM picks the module."""
    for key in keys:
        if ".mlp.experts.local_experts." in key:
            return SEQUENTIAL
        if key.endswith((".mlp.experts.weight1", ".mlp.experts.weight2")):
            return GROUPED_GEMM
        if _TE.search(key):
            return TE_GROUPED
    if not getattr(args, "moe_grouped_gemm", False):
        return SEQUENTIAL
    return TE_GROUPED if getattr(args, "transformer_impl", "local") == "transformer_engine" else GROUPED_GEMM


def source_grouped_gemm(args: Any, expert_layout: str | None) -> bool:
    """Whether a Megatron source holds GroupedMLP experts (the layout a reshard keeps by default): a legacy
    file's ``expert_layout``; torch_dist (which stores every layout alike) by its args."""
    if expert_layout is not None:
        return expert_layout == GROUPED_GEMM
    return bool(getattr(args, "moe_grouped_gemm", False)) and \
        getattr(args, "transformer_impl", "local") != "transformer_engine"


def stored_key(key: str, layout: str) -> tuple[str, int | None]:
    """Where the SequentialMLP expert key ``key`` (local expert i) is in a file of ``layout``:
    ``(key, None)`` for a tensor of its own, ``(weight1|weight2 key, i)`` for block i of a GroupedMLP
    tensor. Non-expert keys are returned as they are."""
    m = _LOCAL.search(key)
    if m is None or layout == SEQUENTIAL:
        return key, None
    i, fc, head = int(m.group(1)), m.group(2), key[:m.start()]
    if layout == TE_GROUPED:
        return f"{head}.mlp.experts.linear_fc{fc}.weight{i}", None
    return f"{head}.mlp.experts.weight{fc}", i


def fc_of(key: str) -> int:
    """1 or 2: which expert linear a GroupedMLP key (``...weight1`` / ``...weight2``) holds."""
    return int(key[-1])


def grouped_shape(fc: int, local: int, hidden: int, ffn: int, tp: int) -> tuple[int, int]:
    """Per-TP-rank shape of GroupedMLP's ``weight{fc}`` for ``local`` experts of width ``ffn``."""
    return (hidden, local * 2 * ffn // tp) if fc == 1 else (local * ffn // tp, hidden)


def grouped_block(weight: torch.Tensor, slot: int, local: int, hidden: int, fc: int) -> torch.Tensor:
    """Local expert ``slot``'s SequentialMLP shard (fc1 ``[2F/tp, H]``, fc2 ``[H, F/tp]``; a view) out
    of a GroupedMLP ``weight{fc}`` shard, as megatron-core's forward views it."""
    if fc == 1:
        return weight.reshape(local, hidden, -1)[slot].t()
    return weight.reshape(local, -1, hidden)[slot].t()


def pack_grouped(shards: list[torch.Tensor], fc: int) -> torch.Tensor:
    """GroupedMLP's ``weight{fc}`` shard from the SequentialMLP shards of its local experts, in order."""
    import torch

    blocks = torch.stack([s.t() for s in shards])  # [E_local, H, 2F/tp] or [E_local, F/tp, H]
    return blocks.reshape(blocks.shape[1], -1) if fc == 1 else blocks.reshape(-1, blocks.shape[2])
