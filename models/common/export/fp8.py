"""FP8 rollout weights: the one rule for which tensors are stored as block-wise FP8 and how.

Read by every export path (``iter_export(..., quantization="fp8")`` for HF and vLLM buckets,
``save_pretrained``, ``save_vllm_sharded_state``) and meant for ``pmz convert --quantize fp8``:
``quantize_named`` turns ``(name, tensor)`` pairs of one weight-map entry into what is stored.

Format (DeepSeek-V3's, as vLLM's ``Fp8LinearMethod`` and transformers' ``FineGrainedFP8`` read it;
``quantization_config`` below):
  * every linear weight ``W [..., rows, cols]`` (``ROLES``: attention and MLP projections, routed and
    shared experts, the vision blocks' linears, a Gated DeltaNet layer's ``in_proj_qkvz`` (HF
    ``in_proj_qkv``/``in_proj_z``) and ``out_proj``, an MTP block's ``fc`` and decoder-layer linears) is
    stored as ``float8_e4m3fn`` under its own name,
    plus ``<name>_scale_inv`` (fp32, ``[..., ceil(rows/128), ceil(cols/128)]``): one scale per
    128x128 block of the grid that starts at row 0 / column 0; the last row and column of blocks
    may be partial (smaller than 128), as DeepSeek's layout has them. Dequantized weight =
    ``fp8 * scale_inv`` of its block.
  * per block, in fp32 from the source weights: ``scale_inv = amax / 448`` (448: e4m3's largest
    finite value); a block whose ``scale_inv`` is not a positive finite number (all zeros, an
    underflow, inf or NaN inside) gets ``scale_inv = 1`` (transformers', verl's and
    Megatron-Bridge's convention for an all-zero block); ``fp8 = e4m3(clamp(W / scale_inv, -448,
    448))`` with torch's round-to-nearest-even cast. Dividing by the stored ``scale_inv`` (rather
    than multiplying by a separately rounded ``448 / amax``) keeps ``fp8 * scale_inv`` the nearest
    e4m3 grid point of ``W`` in every block.
  * everything else keeps the source dtype (or the export's ``dtype``): embeddings, norms, biases,
    the LM head, the MoE router and shared-expert gate, the vision patch embedding and merger, and a
    Gated DeltaNet layer's ``in_proj_ba`` (HF ``in_proj_b``/``in_proj_a``: vLLM builds it for FP8 but its
    ``[b | a]`` rows, 2 x value heads, are not block-sized, and Qwen3-Next's FP8 release keeps it in BF16),
    ``conv1d`` (vLLM builds it without a quantization config), ``A_log``, ``dt_bias`` and gated norm.
    The kept linear modules are listed in ``modules_to_not_convert`` so that loaders that would
    otherwise quantize every linear (vLLM: ``ignored_layers``; transformers on GPU) leave them alone.
  * a vision tower under ``model.visual.`` in HF names (``TOWER_PREFIX``: Qwen3-VL's and Qwen3-VL-MoE's,
    and the Qwen3.5 conditional-generation tower, whether the model runs it, ``ParallelQwen3_5VL``'s weight-map
    entries ``visual.*``, or carries it, ``cfg.carried`` of the text build and the converters) is never
    quantized, whatever its parameter names look like (``tower_role``, read by ``entry_role`` for every
    weight-map entry whose HF names all sit there: the one rule, declared by the weight map's HF names). The
    language model (and MTP block) is quantized exactly as in a text-only checkpoint, the tower stays in the
    output dtype and its linear modules (``attn.qkv``, ``attn.proj``, ``mlp.linear_fc1/2``, ``merger.`` and
    ``deepstack_merger_list.N.linear_fc1/2``) are listed in ``modules_to_not_convert`` after the text model's, by
    their HF names (``TOWER_LINEAR``). Those are the names transformers' conditional-generation classes give the
    modules (its FP8 loader matches them against module names), and vLLM 0.32 reads them too: its
    ``Fp8Config.apply_vllm_mapper`` renames the list with the model's ``hf_to_vllm_mapper``
    (``model.visual.`` -> ``visual.``; ``model.language_model.`` -> ``language_model.model.``) and
    ``is_layer_skipped`` matches each tower layer's prefix (``visual.blocks.N.attn.qkv``, ``qkv`` being its own
    packed mapping) exactly. (Qwen2-VL / Qwen2.5-VL name their tower ``visual.*`` in HF names: the
    ``vision attention`` / ``vision MLP`` roles quantize its blocks, as vLLM's FP8 release checkpoints do.)

vLLM shards (``save_vllm_sharded_state``, ``iter_export("vllm")``): a rank's shard of a packed
parameter is quantized as one tensor. vLLM (0.32, ``validate_fp8_block_shape`` and the block-scale
loaders in ``linear.py``) loads each part's scale rows at ``ceil(offset/128)`` and each rank's rows
at ``rank * ceil(rows/128)``, so the scales are only consistent when every TP boundary and every
packing boundary (q|k|v, gate|up, the fused vision q|k|v) falls on a block edge; ``vllm_block_check``
refuses the rest before any work, naming the numbers. Where it passes, a rank's FP8 shard and
scales are exactly the rows/blocks of the HF FP8 tensors (tests/test_fp8_export.py).
"""

from __future__ import annotations

import math
import re
from typing import Iterable, Sequence

import torch

from models.common.hybrid.vision import VISUAL_PREFIX

QUANTIZATIONS = ("fp8",)  # what ``quantization=`` accepts besides None
BLOCK = 128  # rows and columns of one scale block
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_SUFFIX = "_scale_inv"  # ``<name>_scale_inv``: ``...proj.weight_scale_inv``, ``...w13_weight_scale_inv``

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}

# vLLM's FP8 attention (``Fp8KVCacheMethod``) registers four more scalar parameters per layer that its
# strict ``sharded_state`` loader wants; -1.0 is its own "not in the checkpoint" value (the KV cache stays
# unquantized and they are ignored), which is what loading the HF FP8 directory leaves in them.
VLLM_KV_SCALES = ("k_scale", "v_scale", "q_scale", "prob_scale")
VLLM_KV_SCALE_VALUE = -1.0

# Every parameter of every architecture's weight map has a role (by internal name): quantized
# linear weights, or kept tensors. A name with no role is an error, so a new architecture must say.
QUANTIZED_ROLES = (
    (r"^model\.layers\.\d+\.self_attn\.(qkv|o)_proj\.weight$", "attention projection"),
    (r"^model\.layers\.\d+\.linear_attn\.(in_proj_qkvz|out_proj)\.weight$", "Gated DeltaNet projection"),
    (r"^mtp\.fc\.weight$", "MTP projection"),
    (r"^model\.layers\.\d+\.mlp\.(gate_up|down)_proj\.weight$", "MLP projection"),
    (r"^model\.layers\.\d+\.mlp\.experts\.w(13|2)_weight$", "routed experts"),
    (r"^model\.layers\.\d+\.mlp\.shared_expert\.(gate_up|down)_proj\.weight$", "shared expert"),
    (r"^visual\.blocks\.\d+\.attn\.(qkv|proj)\.weight$", "vision attention"),
    (r"^visual\.blocks\.\d+\.mlp\.(fc1|fc2|gate_up_proj|down_proj)\.weight$", "vision MLP"),
)
KEPT_ROLES = (
    (r"\.bias$", "bias"),
    (r"(norm\d?|ln_q|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight$", "norm"),
    (r"^model\.layers\.\d+\.linear_attn\.in_proj_ba\.weight$", "Gated DeltaNet b/a projection"),
    (r"^model\.layers\.\d+\.linear_attn\.(conv1d\.weight|A_log|dt_bias)$", "Gated DeltaNet conv and decay"),
    (r"^model\.embed_tokens\.weight$", "embedding"),
    (r"^lm_head\.weight$", "LM head"),
    (r"^model\.layers\.\d+\.mlp\.gate\.weight$", "MoE router"),
    (r"^model\.layers\.\d+\.mlp\.shared_expert_gate\.weight$", "shared-expert gate"),
    (r"^visual\.patch_embed\.proj\.weight$", "vision patch embedding"),
    (r"^visual\.merger\.mlp\.\d+\.weight$", "vision merger"),
)
# kept tensors of linear modules (transformers' nn.Linear, vLLM's LinearBase with the quant config)
KEPT_LINEAR_ROLES = ("LM head", "MoE router", "shared-expert gate", "vision merger", "Gated DeltaNet b/a projection")
MTP_LAYER = re.compile(r"^mtp\.layers\.")  # an MTP decoder layer's tensors take the decoder layers' roles
# A vision tower kept whole in high precision, by the HF names of its weight-map entries or carried tensors
# (module doc); its linear modules (HF weight names) are listed in ``modules_to_not_convert``.
TOWER_PREFIX = VISUAL_PREFIX
TOWER_LINEAR = re.compile(r"^model\.visual\.(blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])"
                          r"|(merger|deepstack_merger_list\.\d+)\.linear_fc[12])\.weight$")
CARRIED_PREFIX, CARRIED_LINEAR = TOWER_PREFIX, TOWER_LINEAR  # the names before the tower could also be held

class QuantizationError(ValueError):
    """A quantization that cannot be done as asked (the value or the numbers are named)."""


def check_quantization(quantization) -> None:
    """``None`` (no quantization) or one of ``QUANTIZATIONS``; anything else is refused in one line."""
    if quantization is not None and (not isinstance(quantization, str) or quantization not in QUANTIZATIONS):
        raise QuantizationError(f"quantization={quantization!r} is not a format we write "
                                f"(choose {', '.join(map(repr, QUANTIZATIONS))} or None)")


def role(param: str) -> tuple[str, bool]:
    """``(role, quantized)`` of a weight-map parameter (internal name); QuantizationError if it has none."""
    name = MTP_LAYER.sub("model.layers.", param)
    for table, quantized in ((QUANTIZED_ROLES, True), (KEPT_ROLES, False)):
        for pattern, what in table:
            if re.search(pattern, name):
                return what, quantized
    raise QuantizationError(f"{param}: no FP8 role (models/common/export/fp8.py lists which tensors are quantized)")


def tower_role(hf_name: str) -> tuple[str, bool]:
    """``(role, False)`` of a vision-tower tensor (HF name under ``TOWER_PREFIX``): never quantized;
    QuantizationError for any other name."""
    if not hf_name.startswith(TOWER_PREFIX):
        raise QuantizationError(f"{hf_name}: not a vision-tower tensor ({TOWER_PREFIX}*)")
    return ("vision-tower linear" if TOWER_LINEAR.match(hf_name) else "vision tower"), False


carried_role = tower_role  # a carried tower's tensors (the converters' and the text build's name)


def in_tower(entry) -> bool:
    """Whether a weight-map entry belongs to a kept vision tower: all its HF names under ``TOWER_PREFIX`` (a
    vision-language model's ``visual.*`` entries, a hybrid's carried entries, vLLM's ``visual.*`` entries)."""
    return bool(entry.hf) and all(name.startswith(TOWER_PREFIX) for name in entry.hf)


def entry_role(entry) -> tuple[str, bool]:
    """``(role, quantized)`` of a weight-map entry: a tower entry's by its HF names (``tower_role``), any
    other's by its parameter name (``role``)."""
    if in_tower(entry):
        roles = [tower_role(name) for name in entry.hf]
        return roles[0][0], any(quantized for _, quantized in roles)
    return role(entry.param)


def is_quantized(entry) -> bool:
    """Whether a weight-map entry's tensors are stored as FP8 (the same for all its HF parts; never for a tower's)."""
    return entry_role(entry)[1]


def tower_linear_modules(names: Iterable) -> list[str]:
    """HF module names of a tower's linear modules among ``names`` (HF tensor names, or ``(name, shape)`` pairs
    such as ``cfg.carried``), in their order; other names (norms, embeddings, an MTP block's tensors) give none."""
    names = [c if isinstance(c, str) else c[0] for c in names]
    return [n.removesuffix(".weight") for n in names if TOWER_LINEAR.match(n)]


carried_linear_modules = tower_linear_modules


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def scale_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of the scales of a weight of ``shape`` (leading dims kept: expert stacks)."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))


def scale_offset(shape: Sequence[int], offset: int) -> int:
    """Element offset, in the scales of a weight of ``shape`` (``[..., rows, cols]``), of the block row that starts
    at element ``offset`` of the weight: a range of whole rows of one matrix starting on a block edge (an expert's
    gate or up rows inside a fused ``gate_up_proj``) is quantized on its own exactly as inside the whole tensor,
    and its scales are a contiguous range there too. QuantizationError for any other start."""
    *_, rows, cols = shape
    matrix, rest = divmod(offset, rows * cols)
    row, col = divmod(rest, cols)
    if col or row % BLOCK:
        raise QuantizationError(f"element {offset} of a {list(shape)} weight starts row {row} (column {col}) of its "
                                f"matrix: not on a {BLOCK}-row block edge, so its scale blocks are shared")
    return (matrix * math.ceil(rows / BLOCK) + row // BLOCK) * math.ceil(cols / BLOCK)


def fused_expert_starts(shapes: Sequence[tuple[str, Sequence[int]]], quantized: set[str]
                        ) -> dict[str, tuple[str, int, int]]:
    """Experts stored fused in HF (``WeightMap.fused_experts``, Qwen3-VL-MoE: ``mlp.experts.gate_up_proj [E, 2F, H]``
    / ``down_proj [E, H, F]``, as transformers 5.24 holds them, its FP8 model's ``FP8Experts`` too, with
    ``gate_up_proj_scale_inv [E, 2F/128, H/128]`` / ``down_proj_scale_inv``): per quantized per-expert tensor of
    ``shapes`` (HF name, shape, in the weight map's order), (its fused tensor, its element offset there, its
    scales' element offset in the fused tensor's scales). Each expert's gate, up and down rows are quantized on
    their own, which is the fused matrix's quantization only when each starts on a 128-row block edge of it
    (``scale_offset``: else QuantizationError naming the tensor, e.g. ``moe_intermediate_size`` not a multiple of
    128). The one rule of the HF FP8 writers (``save_pretrained``, ``converters/torch_path/hf_fp8.py``) and of the
    FP8 reader."""
    from models.common.hf_files import fused_expert_layout

    layout, within = fused_expert_layout([(n, tuple(s)) for n, s in shapes])
    fused_shapes = dict(layout)
    out = {}
    for name, (fused, offset) in within.items():
        if name in quantized:
            try:
                out[name] = (fused, offset, scale_offset(fused_shapes[fused], offset))
            except QuantizationError as exc:
                raise QuantizationError(f"FP8 of experts stored fused: {name} in {fused} "
                                        f"{list(fused_shapes[fused])}: {exc}") from None
    return out


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8, scale_inv)`` of ``weight [..., rows, cols]`` (bf16/fp16/fp32), computed in fp32 (module doc)."""
    w = weight.detach().to(torch.float32)
    *lead, rows, cols = w.shape
    br, bc = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
    padded = torch.zeros((*lead, br * BLOCK, bc * BLOCK), dtype=torch.float32, device=w.device)
    padded[..., :rows, :cols] = w  # zero padding: never raises a block's amax
    blocks = padded.view(*lead, br, BLOCK, bc, BLOCK)
    scale_inv = blocks.abs().amax(dim=(-3, -1)) / FP8_MAX
    scale_inv = torch.where(torch.isfinite(scale_inv) & (scale_inv > 0), scale_inv, torch.ones_like(scale_inv))
    q = (blocks / scale_inv[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(*lead, br * BLOCK, bc * BLOCK)[..., :rows, :cols].contiguous()
    return q, scale_inv.contiguous()


def dequantize(fp8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8 * scale_inv`` of each block, in fp32, returned as ``dtype``."""
    *_, rows, cols = fp8.shape
    scales = scale_inv.repeat_interleave(BLOCK, dim=-2)[..., :rows, :].repeat_interleave(BLOCK, dim=-1)[..., :cols]
    return (fp8.to(torch.float32) * scales).to(dtype)


def quantize_named(pairs: Iterable[tuple[str, torch.Tensor]], quantized: bool,
                   dtype: torch.dtype | None) -> list[tuple[str, torch.Tensor]]:
    """What is stored for the tensors of one entry: ``(name, fp8), (name_scale_inv, fp32)`` per tensor
    when ``quantized``, else ``(name, tensor)`` cast to ``dtype`` (None: unchanged)."""
    out = []
    for name, tensor in pairs:
        if quantized:
            q, s = quantize(tensor)
            out += [(name, q), (scale_name(name), s)]
        else:
            out.append((name, tensor if dtype is None else tensor.to(dtype)))
    return out


def stored_layout(name: str, shape: Sequence[int], quantized: bool,
                  dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of what ``quantize_named`` stores for one tensor (planning, indexes)."""
    if quantized:
        return [(name, tuple(shape), FP8_DTYPE), (scale_name(name), scale_shape(shape), torch.float32)]
    return [(name, tuple(shape), dtype)]


def vllm_attention_scales(quantization) -> list[tuple[str, float]]:
    """``(name, value)`` of the extra fp32 scalars each attention layer's ``self_attn.attn.<name>``
    needs in a vLLM ``sharded_state`` of this quantization (none without one)."""
    return [(name, VLLM_KV_SCALE_VALUE) for name in VLLM_KV_SCALES] if quantization else []


def modules_to_not_convert(weight_map, num_layers: int, carried: Iterable = ()) -> list[str]:
    """HF module names of the kept linear modules: ``lm_head`` always first (tied or not: transformers builds it
    as a Linear), then the text model's (``KEPT_LINEAR_ROLES``), then a vision tower's (``tower_linear_modules``
    of the weight map's tower entries, or of a carried tower: ``carried``, ``cfg.carried``)."""
    names, tower = ["lm_head"], []
    for entry in weight_map.entries(range(num_layers)):
        what, quantized = entry_role(entry)
        if in_tower(entry):
            tower += tower_linear_modules(entry.hf)
        elif not quantized and what in KEPT_LINEAR_ROLES and entry.param.endswith(".weight"):
            names += [h.removesuffix(".weight") for h in entry.hf if h.removesuffix(".weight") not in names]
    tower += tower_linear_modules(carried)
    return names + [n for n in dict.fromkeys(tower) if n not in names]


def quantization_config(weight_map, num_layers: int, carried: Iterable = ()) -> dict:
    """config.json's ``quantization_config`` for an FP8 export of a model with this weight map (and, for a
    hybrid's conditional-generation checkpoint, the tower ``carried``: its config's ``carried``)."""
    return {**QUANTIZATION_CONFIG,
            "modules_to_not_convert": modules_to_not_convert(weight_map, num_layers, carried)}


def _generic(name: str) -> str:
    return re.sub(r"\.(layers|blocks|experts)\.\d+\.", r".\1.*.", name)


def _layer_kinds(vmap, num_layers: int) -> list[int]:
    """One layer of each kind of ``vmap`` (layers of a kind share templates, hence shapes): dense and sparse
    MLPs, and a hybrid's linear- and full-attention layers."""
    kinds: dict[tuple[str, ...], int] = {}
    for i in range(num_layers):
        kinds.setdefault(tuple(e.param for e in vmap.layer_templates(i)), i)
    return sorted(kinds.values())


def vllm_block_problems(vmap, cfg, shapes: dict, tp: int) -> list[str]:
    """Why vLLM at TP ``tp`` could not take FP8 shards of ``vmap`` (vLLM's rules, one message per
    tensor and reason, every layer alike), empty when it can: a TP boundary inside a split dimension
    or a packing boundary that is not a multiple of 128. A part whose rank piece is several ranges
    (``Fused`` blocks, ``Blocks`` such as a Gated DeltaNet ``in_proj_qkv`` or its ``[q | k | v]`` blocks)
    is checked range by range: each is cut at the TP boundary and packed before the next one."""
    problems: list[str] = []
    for entry in vmap.entries(_layer_kinds(vmap, cfg.num_hidden_layers)):
        if not is_quantized(entry):
            continue
        parts = [(entry.hf[j], rule) for j, rule in enumerate(entry.rules)]
        for j, (name, rule) in enumerate(parts):
            shape = shapes[name]
            piece = rule.piece(shape, 0, tp)
            if piece.dim is None:
                continue
            ranges = piece.ranges(shape[piece.dim])
            what = "rows" if piece.dim == 0 else "columns"
            for k, (start, stop, _) in enumerate(ranges):
                size = stop - start
                if not size % BLOCK:
                    continue
                last = j == len(parts) - 1 and k == len(ranges) - 1
                if tp > 1:
                    whole = size * tp if len(ranges) > 1 else shape[piece.dim]
                    where = (" per fused block" if piece.chunks > 1 else
                             f" in block {k + 1} of {len(ranges)}" if len(ranges) > 1 else "")
                    problems.append(f"{_generic(name)}: {size} {what} per rank (of {whole}{where}) is not a multiple "
                                    f"of {BLOCK}: a shard boundary cuts a {BLOCK}x{BLOCK} block")
                elif not last:
                    problems.append(f"{_generic(name)}: {size} {what} packed before the next part of "
                                    f"{_generic(entry.param)} is not a multiple of {BLOCK} (vLLM packs each part's "
                                    f"blocks after the previous part's)")
    return list(dict.fromkeys(problems))


def vllm_block_check(vmap, cfg, shapes: dict, tp: int) -> None:
    """QuantizationError naming the numbers when vLLM at TP ``tp`` could not take the FP8 shards."""
    problems = vllm_block_problems(vmap, cfg, shapes, tp)
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise QuantizationError(f"FP8 vLLM shards at tp={tp}: " + "; ".join(problems[:3]) + more)
