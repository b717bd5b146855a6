"""vLLM's internal weight layout, derived from the architecture's weight map (no second table).

vLLM (0.32) holds, per tensor-parallel rank, parameters under the names our models use internally
(``qkv_proj`` = ``[q_r | k_r | v_r]``, ``gate_up_proj`` = ``[gate_r | up_r]``), so a vLLM shard of rank ``r``
of ``N`` is the weight map's ``Packed`` rules applied at size ``N`` - with one change: vLLM pads the vocabulary
to a multiple of 64 (``ParallelLMHead``/``VocabParallelEmbedding``) and then splits it evenly over TP, whatever
padding the training job used. KV heads follow the ``KVHeads`` rule (replicated ``N / kv`` times when
``N > kv``), row-parallel biases are whole.

Names in ``sharded_state`` files: vLLM's loader matches the keys of ``model.state_dict()`` after dropping
tensors that share memory with another (keeping the alphabetically smaller key). With tied embeddings the stage
holding the LM head therefore expects ``lm_head.weight``; a first stage without the head keeps the embedding's.
Each attention layer also carries four fp32 scalars (``self_attn.attn._k_scale``, ``_v_scale``,
``_q_scale``, ``_prob_scale``; 1.0 for unquantized KV caches) that the strict loader requires.

Pipeline stages: layers as ``vllm.distributed.utils.get_pp_indices`` splits them, the embedding, final norm and LM
head on the stages the architecture's vLLM class builds them (some on every stage): ``vllm_stages``. Parts:
``split_parts``.

Vision-language models (Qwen2-VL, Qwen2.5-VL, checked against vLLM 0.32 in tests/test_vllm_vl.py; Qwen3-VL in
tests/test_convert_qwen3_vl.py, its facts in ``vllm_vision``): vLLM wraps the text model, so its keys gain
``language_model.`` (``language_model.model.layers.N...``, ``language_model.lm_head.weight``, the attention scales
too); the tower keeps HF's ``visual.*`` and is built whole on *every* pipeline stage, so each stage's files carry it.
Qwen2-VL's ``attn.qkv`` is one ColumnParallelLinear over the fused ``[q | k | v]`` rows, split contiguously (vLLM
all-gathers it and re-splits per head in ``split_qkv``), not per q/k/v block as our training layout (``Fused``);
Qwen2.5-VL's and Qwen3-VL's are a QKVParallelLinear (rank r holds ``[q_r | k_r | v_r]``: our ``Fused`` layout as it
is), Qwen2.5-VL's MLP a MergedColumnParallelLinear ``mlp.gate_up_proj`` (``[gate_r | up_r]``, our packing, our name).

Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next; vLLM 0.32's ``qwen3_5.py``, ``qwen3_next.py`` and
``QwenGatedDeltaNetAttention``, checked against vLLM building and loading them in tests/test_vllm_hybrid.py):
the model's names and packing are vLLM's (``models/common/hybrid/weights.py``): ``linear_attn.in_proj_qkvz``
``[q_r | k_r | v_r | z_r]`` (Qwen3.5: a MergedColumnParallelLinear of the four blocks), ``in_proj_ba``
``[b_r | a_r]``, ``conv1d`` ``[q_r | k_r | v_r]`` channels (vLLM's ``mamba_v2_sharded_weight_loader``),
``A_log``/``dt_bias`` split by value head, the gated ``norm`` whole, ``out_proj`` row-parallel; the gated
attention's ``qkv_proj`` is a QKVParallelLinear over ``2 * heads`` query heads (each head's query then its
gate). One difference: Qwen3-Next's GDN (``gqa_interleaved_layout``) builds ``in_proj_qkvz``/``in_proj_ba``
with ONE output size, so a rank holds contiguous rows of the head-group-interleaved HF tensor (its run of
key-head groups, still interleaved), where our model de-interleaves them (rule ``Groups``): vLLM's rule there
is ``Split(0)``. Only full-attention layers carry the four attention scales. vLLM splits the GDN by key-head
groups (``num_k_heads // tp`` per rank in its kernels, value heads and conv channels with ``divide``), so tp
must divide ``linear_num_key_heads``. The MoE blocks are Qwen2-MoE's fused-MoE wrapping (shared expert and
its gate inside ``mlp.experts``) with the router handed to it too (``mlp.experts.gate``, as Qwen3-MoE). vLLM's
main model holds no MTP block (its ``mtp.*`` tensors are a separate draft model's), so none is written.
vLLM's map is built from the model's own weight map (``vllm_map``), never from the converters' map, whose
hybrid linear layers merge the two projections as Megatron stores them.

Conditional-generation checkpoints of the hybrids (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``: ``cfg.carried`` holds the vision tower, the decoder under
``model.language_model.``): vLLM 0.32 builds the same classes from that config (``qwen3_5.py``, its tower
``qwen3_vl.Qwen3_VisionTransformer``), so the text model's keys gain ``language_model.`` (its
``hf_to_vllm_mapper``: ``model.language_model.`` -> ``language_model.model.``, ``lm_head.`` ->
``language_model.lm_head.``) and the tower ``model.visual.*`` becomes ``visual.*``, built whole on every
pipeline stage. In vLLM's default ``mm_encoder_tp_mode="weights"`` the tower is tensor-parallel over the
same ranks (``tower_entries``): ``attn.qkv`` a QKVParallelLinear (rank r holds ``[q_r | k_r | v_r]``:
``Fused(3)``), ``attn.proj`` and both ``linear_fc2`` row-parallel (biases whole), both ``linear_fc1``
(block MLP and merger) column-parallel, norms, ``patch_embed`` and ``pos_embed`` whole. Only the converters
hold the tower (``vllm_map``); a model built from such a checkpoint holds the text model only, so its live
exports have no tower: ``iter_export("vllm")`` yields the text model under the engine's names (a weight sync
into a running vLLM engine of the checkpoint, whose tower is left as loaded), and a ``sharded_state`` listing
without the tower is refused (``stage_tensors``: vLLM's strict loader would miss every ``visual.*`` key).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Sequence

from models.common.architecture import Architecture
from models.common.config import ModelConfig
from models.common.hybrid.vision import VISUAL_PREFIX
from models.common.hybrid.weights import HybridWeightMap
from models.common.vllm_stages import pp_layer_ranges, stage_parts
from models.common.vllm_vision import deepstack_stage_problems
from models.common.weight_map import WeightEntry, WeightMap  # plain data: converters read this torch-free
from parallel.sharding import Fused, Groups, Replicated, ShardingError, Split, Vocab

VOCAB_MULTIPLE = 64
ATTENTION_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
TIED_HEAD_KEY = "lm_head.weight"
LANGUAGE_MODEL_PREFIX = "language_model."  # vLLM's vision-language models hold the text model under it
VISION_PREFIX = "visual."
NO_O_PROJ_BIAS = ("qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe")  # vLLM 0.32 Qwen3 attention: no o_proj bias
CONTIGUOUS_VISION_QKV = ("qwen2_vl",)  # vLLM splits these architectures' vision qkv as one ColumnParallelLinear
NEVER_TIED = ("qwen3_next",)  # vLLM 0.32 builds these architectures' lm_head on its own, never tied to the embedding


class VllmLayoutError(ValueError):
    """A vLLM layout (tp, pp) this model cannot take; the numbers are named in the message."""


def padded_vocab(vocab_size: int) -> int:
    """vLLM's padded vocabulary: the next multiple of 64."""
    return math.ceil(vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def entry_with_vocab_padding(entry: WeightEntry, padded: int | None) -> WeightEntry:
    """``entry`` with its ``Vocab`` rules padding to ``padded`` rows (None: no padding, the HF tensor)."""
    rules = tuple(Vocab(r.vocab_size, padded or r.vocab_size) if isinstance(r, Vocab) else r for r in entry.rules)
    return replace(entry, rules=rules)


def with_vocab_padding(wmap: WeightMap, padded: int) -> WeightMap:
    """The same weight map with every ``Vocab`` rule padding to ``padded`` rows."""
    fix = partial(entry_with_vocab_padding, padded=padded)
    return replace(wmap, layer_entries=tuple(map(fix, wmap.layer_entries)),
                   first_entries=tuple(map(fix, wmap.first_entries)), last_entries=tuple(map(fix, wmap.last_entries)),
                   moe_layer_entries=tuple(map(fix, wmap.moe_layer_entries)))


def _vllm_experts(entry: WeightEntry) -> WeightEntry:
    """vLLM's fused experts (``FusedMoE`` without expert parallelism) split every expert's intermediate
    dimension over TP: ``w13 [E, 2I/tp, H]`` = per expert ``[gate_r | up_r]``, ``w2 [E, H, I/tp]``."""
    if not entry.experts:
        return entry
    rule = Split(1) if entry.param.endswith("w2_weight") else Split(0)
    return replace(entry, rules=tuple(rule for _ in entry.rules))


def _vllm_fused_rows(entry: WeightEntry) -> WeightEntry:
    """vLLM's vision ``attn.qkv`` is a ColumnParallelLinear over the fused rows: a contiguous split."""
    if not any(isinstance(r, Fused) for r in entry.rules):
        return entry
    return replace(entry, rules=tuple(Split(0) if isinstance(r, Fused) else r for r in entry.rules))


def _vllm_groups(entry: WeightEntry) -> WeightEntry:
    """vLLM's Qwen3-Next ``in_proj_qkvz``/``in_proj_ba`` (one output size): contiguous rows of the interleaved
    HF tensor, each rank's key-head groups left interleaved (our model de-interleaves them: ``Groups``)."""
    if not any(isinstance(r, Groups) for r in entry.rules):
        return entry
    return replace(entry, rules=tuple(Split(0) if isinstance(r, Groups) else r for r in entry.rules))


def vllm_weight_map(wmap: WeightMap, cfg: ModelConfig) -> WeightMap:
    """The weight map with vLLM's rules: padded vocabulary, fused experts, contiguous vision qkv, and a
    hybrid's linear layers as vLLM splits them (no MTP block). ``wmap``: the model's own map (``vllm_map``)."""
    padded = with_vocab_padding(wmap, padded_vocab(cfg.vocab_size))
    first = padded.first_entries
    if cfg.architecture in CONTIGUOUS_VISION_QKV:
        first = tuple(map(_vllm_fused_rows, first))
    out = replace(padded, moe_layer_entries=tuple(map(_vllm_experts, padded.moe_layer_entries)), first_entries=first)
    if isinstance(out, HybridWeightMap):
        linear_entries = out.linear_layer_entries + out.linear_moe_layer_entries
        merged = [e.param for e in linear_entries if e.param.endswith(".in_proj")]
        if merged:  # the converters' map (Megatron's one in_proj): vLLM keeps the two projections apart
            raise ValueError(f"vllm_weight_map needs the model's weight map, not a conversion map ({merged[0]})")

        def linear(entries: tuple[WeightEntry, ...]) -> tuple[WeightEntry, ...]:
            return tuple(_vllm_groups(_vllm_experts(e)) for e in entries)

        out = replace(out, linear_layer_entries=linear(out.linear_layer_entries),
                      linear_moe_layer_entries=linear(out.linear_moe_layer_entries), mtp_layers=0)
    return out


def vllm_map(arch: Architecture, cfg: ModelConfig) -> WeightMap:
    """vLLM's weight map of ``arch`` for ``cfg`` as the converters write and read it: with a conditional-generation
    checkpoint's vision tower (``tower_entries``) after the embedding. (The live exports use ``vllm_weight_map``
    of the model's own map, which holds no tower.)"""
    vmap = vllm_weight_map(arch.weight_map(cfg, cfg.vocab_size), cfg)
    tower = tower_entries(cfg)
    return replace(vmap, first_entries=vmap.first_entries + tower) if tower else vmap


def is_conditional_generation(cfg: ModelConfig) -> bool:
    """A hybrid's conditional-generation checkpoint (a vision tower carried beside the text model)."""
    return bool(getattr(cfg, "carried", ()))


# vLLM 0.32's Qwen3-VL tower (``Qwen3_VisionTransformer``, mm_encoder_tp_mode "weights"): the TP rule of each
# tensor by the first fragment of its HF name that matches; anything else (norms, patch_embed, pos_embed) whole
_TOWER_RULES = ((".attn.qkv.", Fused(3)), (".attn.proj.weight", Split(1)), (".linear_fc1.", Split(0)),
                (".linear_fc2.weight", Split(1)))


def tower_entries(cfg: ModelConfig) -> tuple[WeightEntry, ...]:
    """The vision tower of a conditional-generation checkpoint as vLLM holds it: one entry per tensor,
    ``model.visual.X`` -> ``visual.X`` with vLLM's TP rule (module doc); () for other models."""
    out = []
    for name, shape in getattr(cfg, "carried", ()):
        if not name.startswith(VISUAL_PREFIX):
            raise ValueError(f"{cfg.architecture}: carried tensor {name} is not under {VISUAL_PREFIX} (vLLM's map "
                             f"knows only the vision tower)")
        rule = next((r for fragment, r in _TOWER_RULES if fragment in name), Replicated())
        out.append(WeightEntry(VISION_PREFIX + name[len(VISUAL_PREFIX):], (name,), (rule,), None,
                               shapes=(tuple(shape),)))
    return tuple(out)


def vllm_name(key: str, cfg: ModelConfig) -> str:
    """vLLM's name for a key of our text-model layout (``language_model.`` prefixed in a
    vision-language model; vision keys keep theirs)."""
    if (cfg.vision is None and not is_conditional_generation(cfg)) or key.startswith(VISION_PREFIX):
        return key
    return LANGUAGE_MODEL_PREFIX + key


def check_layout(cfg: ModelConfig, tp: int, pp: int = 1) -> None:
    """Refuse a (tp, pp) vLLM would refuse or that the weights cannot be split into (before any work)."""
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise VllmLayoutError(f"vLLM {name} must be a positive integer, got {value!r}")
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    problems = []
    if heads % tp:
        problems.append(f"num_attention_heads={heads} is not divisible by tp={tp}")
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads={kv} and tp={tp}: one must divide the other")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate_size={cfg.intermediate_size} is not divisible by tp={tp}")
    if cfg.moe is not None:
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(cfg.moe, name) % tp:
                problems.append(f"{name}={getattr(cfg.moe, name)} is not divisible by tp={tp}")
    vocab = padded_vocab(cfg.vocab_size)
    if vocab % tp:
        problems.append(f"vLLM's padded vocabulary {vocab} (vocab_size={cfg.vocab_size} rounded up to a multiple "
                        f"of {VOCAB_MULTIPLE}) is not divisible by tp={tp}")
    if pp > cfg.num_hidden_layers:
        problems.append(f"pp={pp} exceeds num_hidden_layers={cfg.num_hidden_layers}")
    if cfg.architecture in NO_O_PROJ_BIAS and cfg.o_bias:
        problems.append(f"attention_bias=True: vLLM's {cfg.architecture} builds o_proj without a bias (transformers "
                        f"adds one), so it cannot hold this model")
    if cfg.moe is not None and cfg.moe.num_experts < tp:
        problems.append(f"num_experts={cfg.moe.num_experts} is smaller than tp={tp} (vLLM refuses it)")
    hk = getattr(cfg, "linear_num_key_heads", 0)
    if hk and "linear_attention" in cfg.layer_types and hk % tp:
        problems.append(f"linear_num_key_heads={hk} is not divisible by tp={tp} (vLLM splits the Gated DeltaNet "
                        f"layers by key-head group, each with its "
                        f"{cfg.linear_num_value_heads // hk} value heads)")
    for entry in tower_entries(cfg):  # vLLM's tower is tensor-parallel over the same ranks
        rule, shape = entry.rules[0], entry.shapes[0]
        rows = shape[0] // 3 if isinstance(rule, Fused) else shape[rule.dim] if isinstance(rule, Split) else 0
        if rows % tp:
            problems.append(f"vision tower {entry.param} {list(shape)}: {rows} is not divisible by tp={tp} "
                            f"(vLLM splits the tower over the same ranks)")
            break
    if cfg.architecture in NEVER_TIED and cfg.tie_word_embeddings:
        problems.append(f"tie_word_embeddings=True: vLLM's {cfg.architecture} builds its own lm_head and never ties "
                        f"it to the embedding, so it cannot hold this model")
    vis = cfg.vision
    if vis is not None:  # vLLM's vision tower is tensor-parallel over the same ranks
        for name, value in (("num_heads", vis.num_heads), ("MLP width", vis.mlp_hidden),
                            ("merger width", vis.merged_dim)):
            if value % tp:
                problems.append(f"vision {name}={value} is not divisible by tp={tp}")
    problems += deepstack_stage_problems(cfg, pp, pp_layer_ranges(cfg.num_hidden_layers, pp))  # Qwen3-VL
    if problems:
        raise VllmLayoutError("vLLM layout tp=%d pp=%d: %s" % (tp, pp, "; ".join(problems)))


def check_hf_config(hf_config, cfg: ModelConfig, tp: int) -> None:
    """What only a conditional-generation checkpoint's config.json says and vLLM needs (the model config keeps
    neither): ``tp`` must divide the vision heads (vLLM's tower QKVParallelLinear splits by head), and the top-level
    ``tie_word_embeddings`` (transformers ties by it) must equal ``text_config``'s (vLLM 0.32 ties by that one:
    otherwise it would serve an LM head that is not the one transformers serves). Nothing for other models."""
    if not is_conditional_generation(cfg):
        return

    def get(obj, name: str):
        return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)

    vision, text = get(hf_config, "vision_config"), get(hf_config, "text_config")
    problems = []
    heads = get(vision, "num_heads") if vision is not None else None
    if isinstance(heads, int) and heads % tp:
        problems.append(f"vision_config.num_heads={heads} is not divisible by tp={tp} (vLLM's tower splits its "
                        f"attention by head over the same ranks)")
    top, inner = bool(get(hf_config, "tie_word_embeddings")), bool(get(text, "tie_word_embeddings"))
    if text is not None and top != inner:
        problems.append(f"tie_word_embeddings={top} but text_config.tie_word_embeddings={inner}: transformers ties "
                        f"the LM head by the first, vLLM 0.32 by the second, so vLLM would serve another model")
    if problems:
        raise VllmLayoutError("vLLM layout tp=%d: %s" % (tp, "; ".join(problems)))


def check_sharded_state_source(wmap: WeightMap, cfg: ModelConfig) -> None:
    """VllmLayoutError when ``wmap`` cannot give every key of a ``sharded_state`` file of ``cfg``: a conditional-
    generation checkpoint's map without the vision tower (the map of a model built from it: vLLM's strict loader
    would miss every ``visual.*`` key). ``stage_tensors`` checks it for every sharded_state listing."""
    if is_conditional_generation(cfg) and len(wmap.first_entries) < 1 + len(cfg.carried):
        raise VllmLayoutError(f"vLLM sharded_state of a {cfg.architecture} conditional-generation checkpoint: vLLM "
                              f"builds its vision-language model (config.json's architectures) and its strict loader "
                              f"needs the vision tower ({len(cfg.carried)} tensors, visual.*), which a model built "
                              f"from the checkpoint does not hold (it runs the text model only): push its weights into "
                              f"an engine started from the checkpoint (iter_export('vllm'), push_to_vllm), or convert "
                              f"a checkpoint that holds the tower (pmz convert CKPT DST --to vllm)")


@dataclass(frozen=True)
class VllmTensor:
    """One tensor of a vLLM rank's state: its key and, for weights, the weight-map entry it packs."""

    key: str
    entry: WeightEntry | None  # None: an attention scale scalar (fp32, 1.0)


def stage_tensors(wmap: WeightMap, cfg: ModelConfig, pp_rank: int, pp: int, *, scales: bool = True,
                  head_alias: bool = True) -> list[VllmTensor]:
    """Keys of vLLM pipeline stage ``pp_rank`` in state-dict order, with the entry each packs.

    ``wmap`` must already carry vLLM's vocabulary padding (``vllm_weight_map``). ``scales``: include
    the attention scale scalars (``sharded_state`` files need them). ``head_alias``: with tied
    embeddings, the stage holding the LM head names the shared tensor ``lm_head.weight`` as
    ``sharded_state`` expects; without it, by its parameter name (``model.embed_tokens.weight``, as
    ``named_parameters()`` of a single-stage vLLM model has it).
    """
    layers = pp_layer_ranges(cfg.num_hidden_layers, pp)[pp_rank]
    has = stage_parts(cfg.architecture, pp_rank, pp)  # embedding, final norm, LM head: on this stage?
    tied = cfg.tie_word_embeddings
    embed, *vision = wmap.first_entries
    if scales:
        check_sharded_state_source(wmap, cfg)
    out: list[VllmTensor] = [VllmTensor(e.param, e) for e in vision]  # every stage holds the vision tower
    if has.embed and not (has.head and tied and head_alias):
        out.append(VllmTensor(vllm_name(embed.param, cfg), embed))
    for i in layers:
        for entry in wmap.layer_templates(i):
            entry = entry.format(i)
            key = _moe_key(entry, cfg, sharded=head_alias)
            if key is not None:
                out.append(VllmTensor(vllm_name(key, cfg), entry))
            if scales and entry.param.endswith("self_attn.o_proj.weight"):
                out += [VllmTensor(vllm_name(f"model.layers.{i}.self_attn.attn.{s}", cfg), None)
                        for s in ATTENTION_SCALES]
    out += [VllmTensor(vllm_name(e.param, cfg), e) for e in wmap.last_entries
            if (has.head if e.param == TIED_HEAD_KEY else has.norm)]
    if has.head and tied and (head_alias or not has.embed):
        out.append(VllmTensor(vllm_name(TIED_HEAD_KEY, cfg), embed))
    return out


# vLLM 0.32's Qwen2-MoE block wraps the shared expert into its fused-MoE layer, so its parameters
# appear under two module paths: ``named_parameters()`` names them by the first
# (``mlp.shared_expert.*``, ``mlp.shared_expert_gate.weight``), ``sharded_state`` files by the
# alphabetically smaller alias (``mlp.experts._shared_experts._layer.*``, the gate as its
# ``expert_gate``). Routed experts live in ``mlp.experts.routed_experts``.
_MOE_PARAM_KEYS = {"mlp.experts.w13_weight": "mlp.experts.routed_experts.w13_weight",
                   "mlp.experts.w2_weight": "mlp.experts.routed_experts.w2_weight"}
_MOE_SHARDED_KEYS = {"mlp.shared_expert.gate_up_proj.weight": "mlp.experts._shared_experts._layer.gate_up_proj.weight",
                     "mlp.shared_expert.down_proj.weight": "mlp.experts._shared_experts._layer.down_proj.weight",
                     "mlp.shared_expert_gate.weight": "mlp.experts._shared_experts._layer.expert_gate.weight"}
# vLLM 0.32 architectures whose sparse block hands its router to the fused-MoE layer (``gate=``, Qwen3-MoE):
# the router is registered twice, ``mlp.gate`` (first: ``named_parameters()``) and ``mlp.experts.gate``
# (alphabetically smaller: the ``sharded_state`` key). Checked by tests/test_qwen3_vllm.py (Qwen3-MoE) and
# tests/test_vllm_hybrid.py (Qwen3.5-MoE and Qwen3-Next, whose sparse block is Qwen2-MoE's shared-expert wrapping
# plus this router hand-over).
_ROUTER_IN_FUSED_MOE = frozenset({"qwen3_moe", "qwen3_vl_moe"})  # Qwen3-VL-MoE's text model is vLLM's Qwen3-MoE
_ROUTER_IN_FUSED_MOE |= {"qwen3_5_moe", "qwen3_next"}  # the Gated DeltaNet hybrids' sparse blocks too


def _moe_key(entry: WeightEntry, cfg: ModelConfig, sharded: bool) -> str | None:
    """vLLM's key of a sparse-layer parameter (None: vLLM has no such tensor); others keep their name."""
    prefix, sep, leaf = entry.param.partition(".mlp.")
    leaf = sep[1:] + leaf
    if cfg.moe is not None and sharded and leaf == "mlp.gate.weight" and cfg.architecture in _ROUTER_IN_FUSED_MOE:
        return f"{prefix}.mlp.experts.gate.weight"
    if cfg.moe is None or leaf not in {**_MOE_PARAM_KEYS, **_MOE_SHARDED_KEYS}:
        return entry.param
    if leaf in _MOE_PARAM_KEYS:
        return f"{prefix}.{_MOE_PARAM_KEYS[leaf]}"
    if not cfg.moe.shared_expert_intermediate_size:  # vLLM builds no shared expert, only its gate
        return entry.param if leaf == "mlp.shared_expert_gate.weight" else None
    return f"{prefix}.{_MOE_SHARDED_KEYS[leaf]}" if sharded else entry.param


def parameter_key(entry: WeightEntry, cfg: ModelConfig) -> str:
    """The name vLLM's ``named_parameters()`` gives ``entry``'s tensor (what ``iter_export("vllm")`` yields)."""
    return vllm_name(_moe_key(entry, cfg, sharded=False) or entry.param, cfg)


def pack_shard(entry: WeightEntry, full: dict, rank: int, size: int):
    """vLLM rank ``rank``'s packed shard of ``entry`` from its full HF tensors ``full`` (by name);
    expert entries give ``[E, ...]`` with every expert packed alike."""
    import torch

    if entry.experts:
        return torch.stack([pack_shard(entry.expert(e), full, rank, size) for e in range(entry.experts)])
    return entry.packed.pack([full[n] for n in entry.hf], rank, size)


def shard_shape(entry: WeightEntry, shapes: dict[str, Sequence[int]], size: int) -> tuple[int, ...]:
    """Shape of one rank's packed shard of ``entry`` at TP ``size`` (``[E, ...]`` for expert stacks)."""
    if entry.experts:
        return (entry.experts, *shard_shape(entry.expert(0), shapes, size))
    parts = [rule.shard_shape(shapes[name], size) for name, rule in zip(entry.hf, entry.rules)]
    if len(parts) == 1:
        return tuple(parts[0])
    return (sum(p[0] for p in parts), *parts[0][1:])


PADDING = -2


@dataclass(frozen=True)
class Transfer:
    """Rows ``[start, stop)`` along ``dim`` of HF part ``part`` of an entry, held by training TP rank
    ``source``: at ``src_offset`` along ``dim`` in that rank's part shard, at ``dst_offset`` in the
    target rank's part shard. ``source`` -1: every rank holds them (replicated; ``dim`` None: the
    whole part); ``source`` ``PADDING``: rows past the real tensor (vocabulary padding), zeros."""

    part: int
    source: int
    dim: int | None
    start: int
    stop: int
    src_offset: int
    dst_offset: int


def transfers(entry: WeightEntry, src_rules: Sequence, shapes: dict[str, Sequence[int]], src_size: int,
              dst_rank: int, dst_size: int) -> list[Transfer]:
    """Which training TP ranks (rules ``src_rules`` at ``src_size``) hold which rows of target rank
    ``dst_rank``'s shard (rules ``entry.rules`` at ``dst_size``): only the rows it needs, each from
    the lowest rank holding it. Rows past the real tensor (vocabulary padding) come as a ``PADDING``
    transfer (zeros). Pieces made of several ranges (``Fused``: one per q/k/v block) are matched
    range by range, so a per-block split in training can feed a contiguous one in the target."""
    out = []
    for part, (name, dst_rule, src_rule) in enumerate(zip(entry.hf, entry.rules, src_rules)):
        shape = shapes[name]
        want = dst_rule.piece(shape, dst_rank, dst_size)
        if want.dim is None:
            out.append(Transfer(part, -1, None, 0, 0, 0, 0))
            continue
        length = shape[want.dim]
        haves = [src_rule.piece(shape, t, src_size) for t in range(src_size)]
        for w_start, w_stop, w_offset in want.ranges(length):
            lo, hi = w_start, min(w_stop, length)
            covered: list[tuple[int, int]] = []
            for t, have in enumerate(haves):
                if have.dim is None:  # not split in training: take it from this rank's own copy
                    if lo < hi:
                        out.append(Transfer(part, -1, want.dim, lo, hi, lo, w_offset))
                    break
                if have.dim != want.dim:
                    raise ShardingError(f"{name}: split along dim {have.dim} in training, dim {want.dim} in the "
                                        f"target")
                for h_start, h_stop, h_offset in have.ranges(length):
                    s, e = max(lo, h_start), min(hi, h_stop, length)
                    if s >= e or any(cs <= s and e <= ce for cs, ce in covered):
                        continue
                    covered.append((s, e))
                    out.append(Transfer(part, t, want.dim, s, e, h_offset + s - h_start, w_offset + s - w_start))
            pad = max(w_start, length)
            if w_stop > pad:
                out.append(Transfer(part, PADDING, want.dim, pad, w_stop, 0, w_offset + pad - w_start))
    return out


def vllm_file_name(tp_rank: int, part: int, pp_rank: int = 0, pp: int = 1) -> str:
    """vLLM ``ShardedStateLoader``'s default file names."""
    if pp > 1:
        return f"model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
    return f"model-rank-{tp_rank}-part-{part}.safetensors"


def starts_part(filled: int, held: int, nbytes: int, limit: int) -> bool:
    """vLLM's ``save_sharded_state`` part rule: a tensor of ``nbytes`` starts a new part when the current one
    holds ``held`` tensors of ``filled`` bytes and would pass ``limit`` (a larger tensor gets a part alone)."""
    return held > 0 and filled + nbytes > limit


def split_parts(sizes: Sequence[int], limit: int) -> list[int]:
    """Each tensor's part (``sizes``: a rank's tensor bytes in order): ``PartSplitter`` without the tensors."""
    out, part, filled, held = [], 0, 0, 0
    for n in sizes:
        part, filled, held = (part + 1, 0, 0) if starts_part(filled, held, n, limit) else (part, filled, held)
        out.append(part)
        filled, held = filled + n, held + 1
    return out


class PartSplitter:
    """vLLM's ``save_sharded_state`` part rule for one rank's files: tensors are collected in order and
    ``write(tensors, part)`` is called for a part before the tensor that would take it past ``limit``
    bytes (``starts_part``); ``close()`` writes the last part."""

    def __init__(self, limit: int, write) -> None:
        self.limit, self.write = limit, write
        self.part, self.size, self.current = 0, 0, {}

    def add(self, key: str, tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if starts_part(self.size, len(self.current), nbytes, self.limit):
            self.close()
        self.current[key] = tensor
        self.size += nbytes

    def close(self) -> None:
        if self.current:
            self.write(self.current, self.part)
            self.part, self.size, self.current = self.part + 1, 0, {}
