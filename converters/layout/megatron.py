"""Megatron tensor layouts as pure functions: HF <-> Megatron "full" tensors <-> Megatron TP shards.

A weight-map entry (models/common/weight_map.py) names the Megatron tensor and its layout tag; this
module knows what the tags mean:

  qkv_interleaved  ``linear_qkv`` rows are, per query group g in order, ``[q heads of g, k_g, v_g]``
                   (``heads/groups`` query heads each ``head_dim`` rows). TP shards are contiguous
                   dim-0 slices of that full tensor (megatron-core keeps this contiguous split also
                   when ``groups < tp``).
  gate_up_stacked  ``linear_fc1`` full tensor is ``[gate; up]`` (torch_dist's global tensor), but a
                   legacy TP shard is ``[gate_r; up_r]``.
  vocab_padded     rows padded to Megatron's padded vocab (zeros), TP shards contiguous in dim 0.
  plain            the HF tensor itself; its TP split follows the HF rule (column: dim 0, row: dim 1
                   for matrices, replicated for norms and row-parallel biases).
  qkv_gated_interleaved  ``linear_qkv`` with megatron-core's ``attention_output_gate``: per query group g
                   ``[queries of g's heads | their output gates | k_g | v_g]`` (HF ``q_proj`` holds each
                   head's query then its gate); TP shards contiguous in dim 0, as ``linear_qkv``.
  packed_components  the parts' row components one after the other, each part's as its sharding rule
                   packs it at TP 1 (Gated DeltaNet ``in_proj``: ``[q | k | v | z | b | a]``, Qwen3-Next's
                   interleaved groups de-interleaved; ``conv1d``: ``[q | k | v]``); a legacy TP shard r is
                   the r-th row chunk of every component in order (``BLOCKS``: the model's packed
                   parameter shard), torch_dist one global tensor per component (``entry.megatron_parts``).
  minus_one        Megatron holds the HF value minus one (the Gated DeltaNet output norm is a plain
                   RMSNorm in HF, zero-centred in megatron-core); computed in fp32 and rounded to the
                   tensor's dtype, each way. A Megatron source's value is carried to a Megatron target
                   as stored (``MEGATRON_VALUE``), so reshards stay bitwise. One implementation for both
                   paths: ``shift_bytes`` on raw bytes (the torch-free copy path), ``shifted`` on a
                   tensor's bytes (the torch path); tested bitwise against torch's arithmetic.

"Full" always means torch_dist's global tensor, so both Megatron formats share the HF conversion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from models.common.config import ModelConfig
from models.common.weight_map import (
    GATE_UP_STACKED,
    MINUS_ONE,
    PACKED,
    PLAIN,
    QKV_GATED,
    QKV_INTERLEAVED,
    VOCAB_PADDED,
    WeightEntry,
)
from parallel.sharding import Blocks, Groups, Replicated, Split

if TYPE_CHECKING:  # the shape and row-range functions serve the torch-free copy path
    import torch

# How a Megatron full tensor is split over TP ranks in a legacy checkpoint.
ROW0 = "dim0"  # contiguous slices of dim 0
COL1 = "dim1"  # contiguous slices of dim 1
GATE_UP = "gate_up"  # [gate_r; up_r]
BLOCKS = "blocks"  # [c1_r; c2_r; ...]: the r-th row chunk of each component (``packed_components``)
REPLICATED = "replicated"
# attribute of an HF tensor read from a Megatron ``minus_one`` tensor: the Megatron value it came from
MEGATRON_VALUE = "_pmz_megatron_value"


class LayoutError(ValueError):
    """A Megatron tensor whose size does not fit the layout (sizes named)."""


def tp_split_kind(entry: WeightEntry, ndim: int) -> str:
    """The legacy TP split of ``entry``'s Megatron tensor.

    Experts (``...local_experts.{e}.linear_fc{1,2}``) are split over the expert-TP group like a
    dense MLP (fc1 ``[gate_r; up_r]``, fc2 on dim 1) although every TP rank of our models holds them
    whole: Megatron-LM's default expert-TP size is the TP size, the layout we read and write."""
    if entry.megatron and ".local_experts." in entry.megatron:
        return GATE_UP if entry.megatron_layout == GATE_UP_STACKED else COL1
    if entry.megatron_layout in (QKV_INTERLEAVED, QKV_GATED, VOCAB_PADDED):
        return ROW0
    if entry.megatron_layout == GATE_UP_STACKED:
        return GATE_UP
    if entry.megatron_layout == PACKED:
        return BLOCKS
    rule = entry.rules[0]
    if isinstance(rule, Replicated):
        return REPLICATED
    if isinstance(rule, Split):
        if rule.dim == 0:
            return ROW0
        return COL1 if ndim > 1 else REPLICATED
    raise LayoutError(f"{entry.megatron}: no Megatron TP split for rule {rule!r}")


def packed_components(entry: WeightEntry) -> list[int]:
    """Rows of each component of a ``packed_components`` entry's Megatron tensor, in order: a ``Blocks`` part's
    blocks, a ``Groups`` part's components (all groups of each), any other part whole."""
    rows = []
    for rule, shape in zip(entry.rules, entry.shapes or ()):
        if isinstance(rule, Blocks):
            rows += list(rule.sizes)
        elif isinstance(rule, Groups):
            rows += [size * rule.groups for size in rule.sizes]
        else:
            rows.append(shape[0])
    if entry.megatron_parts and len(entry.megatron_parts) != len(rows):
        raise LayoutError(f"{entry.megatron}: {len(rows)} components, {len(entry.megatron_parts)} names")
    return rows


def legacy_shards(entry: WeightEntry, full: torch.Tensor, tp: int, name: str = "") -> list[torch.Tensor]:
    """Legacy per-rank shards of ``entry``'s Megatron full tensor."""
    kind = tp_split_kind(entry, full.dim())
    return split_tp(kind, full, tp, name, packed_components(entry) if kind == BLOCKS else None)


def merge_legacy(entry: WeightEntry, shards: Sequence[torch.Tensor], name: str = "") -> torch.Tensor:
    """``entry``'s Megatron full tensor from its legacy per-rank shards."""
    kind = tp_split_kind(entry, shards[0].dim())
    return merge_tp(kind, shards, name, packed_components(entry) if kind == BLOCKS else None)


def split_tp(kind: str, full: torch.Tensor, tp: int, name: str = "",
             blocks: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Legacy per-rank shards of a Megatron full tensor (``blocks``: the component rows of ``BLOCKS``)."""
    import torch

    if kind == REPLICATED:
        return [full] * tp
    if kind == BLOCKS:
        return [torch.cat([full[a:b] for a, b in blocks_shard_rows(blocks, tp, r, name)], dim=0) for r in range(tp)]
    if kind == GATE_UP:
        if full.shape[0] % (2 * tp):
            raise LayoutError(f"{name}: linear_fc1 rows {full.shape[0]} not divisible by 2*tp = {2 * tp}")
        gate, up = full.chunk(2, dim=0)
        return [torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(tp, dim=0), up.chunk(tp, dim=0))]
    dim = 0 if kind == ROW0 else 1
    if full.shape[dim] % tp:
        raise LayoutError(f"{name}: size {full.shape[dim]} of dim {dim} not divisible by tp={tp}")
    return [t.contiguous() for t in full.chunk(tp, dim=dim)]


def blocks_shard_rows(blocks: Sequence[int], tp: int, r: int, name: str = "") -> list[tuple[int, int]]:
    """Rows of a ``BLOCKS`` full tensor (components of ``blocks`` rows) that legacy TP rank ``r`` holds, in
    order: the r-th chunk of every component (``parallel.sharding.Blocks``, the model's own rule)."""
    if any(rows % tp for rows in blocks):
        raise LayoutError(f"{name}: components of {list(blocks)} rows are not divisible by tp={tp}")
    return list(Blocks(tuple(blocks)).piece((sum(blocks),), r, tp).spans)


def merge_tp(kind: str, shards: Sequence[torch.Tensor], name: str = "",
             blocks: Sequence[int] | None = None) -> torch.Tensor:
    """Megatron full tensor from legacy per-rank shards (shapes checked equal across ranks)."""
    import torch

    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise LayoutError(f"{name}: TP ranks hold different shapes {[tuple(s.shape) for s in shards]}")
    if kind == REPLICATED:
        return shards[0]
    if kind == BLOCKS:
        tp = len(shards)
        if sum(blocks) != shards[0].shape[0] * tp or any(rows % tp for rows in blocks):
            raise LayoutError(f"{name}: {tp} shards of {shards[0].shape[0]} rows are not components of "
                              f"{list(blocks)} rows split over tp={tp}")
        parts = [s.split([rows // tp for rows in blocks], dim=0) for s in shards]
        return torch.cat([parts[r][j] for j in range(len(blocks)) for r in range(tp)], dim=0)
    if kind == GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=0 if kind == ROW0 else 1)


def _qkv_dims(cfg: ModelConfig) -> tuple[int, int, int]:
    nh, ng, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if nh % ng:
        raise LayoutError(f"num_attention_heads={nh} not divisible by num_query_groups={ng}")
    return nh, ng, hd


def qkv_interleave(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF q/k/v (weights ``[rows, hidden]`` or biases ``[rows]``) -> Megatron ``linear_qkv``."""
    import torch

    nh, ng, hd = _qkv_dims(cfg)
    rest = q.shape[1:]
    parts = [q.reshape(ng, nh // ng * hd, *rest), k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def qkv_deinterleave(full: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    """Megatron ``linear_qkv`` -> HF [q, k, v]."""
    nh, ng, hd = _qkv_dims(cfg)
    expected = (nh + 2 * ng) * hd
    if full.shape[0] != expected:
        raise LayoutError(f"linear_qkv has {full.shape[0]} rows, expected (heads + 2*groups)*head_dim = "
                          f"({nh} + 2*{ng})*{hd} = {expected}")
    rest = full.shape[1:]
    grouped = full.reshape(ng, (nh // ng + 2) * hd, *rest)
    q, k, v = grouped.split([nh // ng * hd, hd, hd], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def _gated_dims(cfg: ModelConfig) -> tuple[int, int, int]:
    """(heads per query group, groups, head_dim) of a gated ``linear_qkv``."""
    nh, ng, hd = _qkv_dims(cfg)
    return nh // ng, ng, hd


def qkv_gated_interleave(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF ``q_proj`` (per head ``[query | gate]``), ``k_proj``, ``v_proj`` -> gated ``linear_qkv`` (per query
    group ``[queries | gates | k_g | v_g]``)."""
    import torch

    per, ng, hd = _gated_dims(cfg)
    rest = q.shape[1:]
    heads = q.reshape(ng, per, 2, hd, *rest)
    parts = [heads[:, :, 0].reshape(ng, per * hd, *rest), heads[:, :, 1].reshape(ng, per * hd, *rest),
             k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def qkv_gated_deinterleave(full: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    """Gated ``linear_qkv`` -> HF [q_proj (queries and gates per head), k_proj, v_proj]."""
    import torch

    per, ng, hd = _gated_dims(cfg)
    expected = ng * (2 * per + 2) * hd
    if full.shape[0] != expected:
        raise LayoutError(f"linear_qkv has {full.shape[0]} rows, expected (2*heads + 2*groups)*head_dim = "
                          f"(2*{per * ng} + 2*{ng})*{hd} = {expected} (a query output gate per head)")
    rest = full.shape[1:]
    queries, gates, k, v = full.reshape(ng, (2 * per + 2) * hd, *rest).split([per * hd, per * hd, hd, hd], dim=1)
    q = torch.stack([queries.reshape(ng, per, hd, *rest), gates.reshape(ng, per, hd, *rest)], dim=2)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def hf_to_megatron(entry: WeightEntry, tensors: Sequence[torch.Tensor], cfg: ModelConfig,
                   padded_vocab: int) -> torch.Tensor:
    """The Megatron full tensor of ``entry`` from its HF tensors (in ``entry.hf`` order)."""
    import torch

    layout = entry.megatron_layout
    if layout == QKV_INTERLEAVED:
        return qkv_interleave(*tensors, cfg)
    if layout == QKV_GATED:
        return qkv_gated_interleave(*tensors, cfg)
    if layout == PACKED:  # each part as its rule packs it for a single rank: Groups de-interleaved
        return entry.packed.pack(list(tensors), 0, 1)
    if layout == MINUS_ONE:
        source = getattr(tensors[0], MEGATRON_VALUE, None)  # read from a Megatron checkpoint: carried as stored
        if source is not None:
            return source
        return shifted(tensors[0], -1.0)
    if layout == GATE_UP_STACKED:
        return torch.cat(list(tensors), dim=0)
    if layout == VOCAB_PADDED:
        t = tensors[0]
        if padded_vocab < t.shape[0]:
            raise LayoutError(f"{entry.megatron}: padded vocab {padded_vocab} < vocab {t.shape[0]}")
        pad = torch.zeros((padded_vocab - t.shape[0], *t.shape[1:]), dtype=t.dtype)
        return torch.cat([t, pad], dim=0)
    if layout == PLAIN:
        return tensors[0]
    raise LayoutError(f"unknown Megatron layout {layout!r}")


def megatron_to_hf(entry: WeightEntry, full: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    """HF tensors (in ``entry.hf`` order) from the Megatron full tensor of ``entry``."""
    layout = entry.megatron_layout
    if layout == QKV_INTERLEAVED:
        return qkv_deinterleave(full, cfg)
    if layout == QKV_GATED:
        return qkv_gated_deinterleave(full, cfg)
    if layout == PACKED:
        rows = sum(packed_components(entry))
        if full.shape[0] != rows:
            raise LayoutError(f"{entry.megatron}: {full.shape[0]} rows, expected {rows} "
                              f"({' + '.join(map(str, packed_components(entry)))})")
        return [t.contiguous() for t in entry.packed.merge([full], entry.shapes)]
    if layout == MINUS_ONE:
        hf = shifted(full, 1.0)
        setattr(hf, MEGATRON_VALUE, full)
        return [hf]
    if layout == GATE_UP_STACKED:
        # experts and the shared expert carry their own widths (entry.shapes), dense MLPs the config's
        rows = [s[0] for s in entry.shapes] if entry.shapes is not None else [cfg.intermediate_size] * 2
        if full.shape[0] != sum(rows):
            raise LayoutError(f"{entry.megatron}: {full.shape[0]} rows, expected 2*ffn = {sum(rows)}")
        return [t.contiguous() for t in full.split(rows, dim=0)]
    if layout == VOCAB_PADDED:
        if full.shape[0] < cfg.vocab_size:
            raise LayoutError(f"{entry.megatron}: {full.shape[0]} rows, fewer than vocab_size={cfg.vocab_size}")
        return [full[: cfg.vocab_size].contiguous()]
    if layout == PLAIN:
        return [full]
    raise LayoutError(f"unknown Megatron layout {layout!r}")


def hf_row_ranges(entry: WeightEntry, cfg: ModelConfig, full_rows: int) -> list[list[tuple[int, int]]]:
    """For dim-0-split layouts: each HF tensor of ``entry`` as row ranges of the Megatron full tensor.

    Lets a reader hand the writer slices of the memory-mapped TP shards instead of building the
    full tensor and copying the HF tensors out of it.
    """
    layout = entry.megatron_layout
    if layout == QKV_INTERLEAVED:
        nh, ng, hd = _qkv_dims(cfg)
        nq = nh // ng * hd
        group = nq + 2 * hd
        if full_rows != ng * group:
            raise LayoutError(f"{entry.megatron}: {full_rows} rows, expected (heads + 2*groups)*head_dim = "
                              f"{ng * group}")
        parts = ((0, nq), (nq, nq + hd), (nq + hd, group))
        return [[(g * group + a, g * group + b) for g in range(ng)] for a, b in parts]
    if layout == QKV_GATED:  # q_proj: each head's query rows, then its gate rows
        per, ng, hd = _gated_dims(cfg)
        group = (2 * per + 2) * hd
        if full_rows != ng * group:
            raise LayoutError(f"{entry.megatron}: {full_rows} rows, expected (2*heads + 2*groups)*head_dim = "
                              f"{ng * group}")
        q = [(g * group + part * per * hd + j * hd, g * group + part * per * hd + (j + 1) * hd)
             for g in range(ng) for j in range(per) for part in (0, 1)]
        kv = [[(g * group + (2 * per + i) * hd, g * group + (2 * per + i + 1) * hd) for g in range(ng)] for i in (0, 1)]
        return [q, *kv]
    if layout == VOCAB_PADDED:
        if full_rows < cfg.vocab_size:
            raise LayoutError(f"{entry.megatron}: {full_rows} rows, fewer than vocab_size={cfg.vocab_size}")
        return [[(0, cfg.vocab_size)]]
    if layout == PACKED:  # each part's rows as its rule packs them at TP 1 (``hf_to_megatron``), parts in order
        out, start = [], 0
        for rule, shape in zip(entry.rules, entry.shapes or ()):
            spans = rule.piece(tuple(shape), 0, 1).spans if isinstance(rule, (Blocks, Groups)) else ()
            placed = []
            for a, b in spans or ((0, shape[0]),):
                placed.append((a, start, start + b - a))
                start += b - a
            out.append([(s, e) for _, s, e in sorted(placed)])  # in the HF tensor's row order
        if start != full_rows:
            raise LayoutError(f"{entry.megatron}: {full_rows} rows, expected {start} "
                              f"({' + '.join(map(str, packed_components(entry)))})")
        return out
    if layout == PLAIN:
        return [[(0, full_rows)]]
    raise LayoutError(f"{entry.megatron}: layout {layout!r} is not a row split")


def shifted(t: torch.Tensor, delta: float) -> torch.Tensor:
    """``minus_one`` on the torch path: ``shift_bytes`` of the tensor's bytes (a norm-sized vector), so both
    paths run one implementation; a NaN is kept as it is (``nan="keep"``). float64 (which the copy path leaves
    to the torch path) in torch's own arithmetic."""
    import torch

    tag = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}.get(t.dtype)
    if tag is None:  # float64: exact in torch's own arithmetic (no rounding to a narrower type to agree on)
        return (t.double() + delta).to(t.dtype)
    data = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    out = shift_bytes(data, tag, delta, nan="keep")
    return torch.frombuffer(bytearray(out), dtype=t.dtype).reshape(t.shape).to(t.device)


def shift_bytes(data: bytes, tag: str, delta: float, nan: str = "refuse") -> bytes:
    """``minus_one`` arithmetic: ``(x.float() + delta).to(dtype)`` of the little-endian values in ``data``
    (``tag`` F32 / BF16 / F16; ``delta`` -1 HF -> Megatron, +1 back), bitwise what torch computes for every
    non-NaN value (tests/test_copy_path_hybrid.py checks every bf16/fp16 value). The sum is taken in Python's
    double and rounded to fp32 (correctly rounded fp32 arithmetic: 53 >= 2 * 24 + 2 bits, so the double
    rounding is exact), then to the tensor's dtype round-to-nearest-even as torch does. torch's own result for a
    NaN depends on which of its kernels ran (scalar 0x7FC0 or vectorised 0xFFFF for bfloat16), so there is no
    one answer: ``nan="refuse"`` (the copy path, which then leaves the tensor to the torch path) raises
    LayoutError, ``nan="keep"`` (the torch path, through ``shifted``) keeps the NaN's bits as they are."""
    import struct

    if tag == "BF16":
        values = [struct.unpack("<f", struct.pack("<I", u << 16))[0] for (u,) in struct.iter_unpack("<H", data)]
    elif tag in ("F32", "F16"):
        values = [v for (v,) in struct.iter_unpack("<f" if tag == "F32" else "<e", data)]
    else:
        raise LayoutError(f"minus_one values in {tag}")
    out = bytearray()
    width = 4 if tag == "F32" else 2
    for i, v in enumerate(values):
        if v != v:
            if nan != "keep":
                raise LayoutError("a NaN among minus_one values")
            out += data[i * width:(i + 1) * width]
            continue
        r = struct.pack("<f", v + delta)  # fp32 result
        if tag == "F32":
            out += r
        elif tag == "F16":
            out += struct.pack("<e", struct.unpack("<f", r)[0])
        else:
            (bits,) = struct.unpack("<I", r)
            out += struct.pack("<H", (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
    return bytes(out)


def slices_of_shards(shards: Sequence[torch.Tensor], ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Views into dim-0 TP shards that, concatenated, are rows ``ranges`` of their concatenation."""
    rows = shards[0].shape[0]
    out = []
    for a, b in ranges:
        while a < b:
            t, off = divmod(a, rows)
            stop = min(b, (t + 1) * rows)
            out.append(shards[t][off:off + stop - a])
            a = stop
    return out


def megatron_full_shape(entry: WeightEntry, hf_shapes: dict[str, tuple[int, ...]], cfg: ModelConfig,
                        padded_vocab: int) -> tuple[int, ...]:
    """Shape of ``entry``'s Megatron full tensor, from the HF shapes (no tensors needed)."""
    first = tuple(hf_shapes[entry.hf[0]])
    if entry.megatron_layout in (QKV_INTERLEAVED, QKV_GATED, GATE_UP_STACKED, PACKED):
        return (sum(hf_shapes[n][0] for n in entry.hf), *first[1:])
    if entry.megatron_layout == VOCAB_PADDED:
        return (padded_vocab, *first[1:])
    return first


def megatron_padded_vocab(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padding: a multiple of ``make_vocab_size_divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
