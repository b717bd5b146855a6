"""LoRA on the shared decoder with peft's semantics: targets, initialisation, merging (adapter files:
``models/common/export/lora_adapter.py``).

``build_parallel_model(..., lora=peft.LoraConfig(r=, lora_alpha=, target_modules=[...]))`` adds
A/B factors (``parallel/lora.py``) to the parallel layers holding the targeted HF modules (HF
module names: ``q_proj`` ... ``down_proj``), sharded like those layers, and freezes every base
parameter. As in peft: ``delta = B A dropout(x) * lora_alpha / r`` (``/ sqrt(r)`` with
``use_rslora``), A initialised Kaiming-uniform (a = sqrt(5)), B zeros, so a fresh adapter changes
nothing. A is drawn from a seed and the HF module name and then sliced, so every TP layout holds
the same adapter.

Mixture-of-experts models: the attention projections (and a shared expert's or dense layer's MLP)
take LoRA as in dense models; a target that selects an expert or the router is refused by name.

Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 conditional generation):
targets are matched against every module transformers' model has, text and tower alike, by peft's rule
(``_selected``: a list entry names a module or a dotted suffix of one, so ``qkv``, ``proj``, ``fc1`` reach
``model.visual.blocks.N.attn.qkv`` ...). The tower's linear layers take LoRA by the same weight-map rules
(its fused ``qkv``: ``Fused(3)``, B per q/k/v block then per head); its patch embedding, a Conv3d whole on
every rank, takes peft's Conv3d LoRA (``PatchLoRA``); its position table (an embedding) is refused by name.

Which rows/columns of A and B a rank holds follows from the weight map: the rule of the adapted
HF tensor (``Split(0)``/``KVHeads`` for column layers: B takes it, A is whole; ``Split(1)`` for
row layers: A takes it, B is whole). Adapter files use peft's names
(``base_model.model.<hf module>.lora_A.weight``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from parallel.config import ParallelConfigError
from parallel.fsdp import unshard
from parallel.lora import ColumnLoRA, PatchLoRA, RowLoRA
from parallel.sharding import Blocks, Fused, Groups, KVHeads, Replicated, Rule, Split

PEFT_PREFIX = "base_model.model."


class LoraError(ValueError):
    """A LoRA configuration or adapter that does not fit the model (names given)."""


@dataclass(frozen=True)
class LoraTarget:
    """One adapted HF module: the parallel layer holding it and how its A/B are sharded."""

    layer: str  # internal module path of the parallel layer, e.g. model.layers.3.self_attn.qkv_proj
    hf_module: str  # as transformers names the module (module_name), e.g. model.layers.3.self_attn.q_proj
    leaf: str  # e.g. q_proj
    column: bool
    a_rule: Rule
    b_rule: Rule
    a_shape: tuple[int, ...]  # full [r, in] (the patch embedding's Conv3d: [r, C, T, P, P])
    b_shape: tuple[int, ...]  # full [out, r] ([out, r, 1, 1, 1])
    packed: tuple[tuple[str, int], ...] = ()  # (HF leaf, full rows) of every projection packed in the layer

    @property
    def a_param(self) -> str:
        return f"{self.layer}.lora.lora_A_{self.leaf}"

    @property
    def b_param(self) -> str:
        return f"{self.layer}.lora.lora_B_{self.leaf}"

    @property
    def peft_a(self) -> str:
        return f"{PEFT_PREFIX}{self.hf_module}.lora_A.weight"

    @property
    def peft_b(self) -> str:
        return f"{PEFT_PREFIX}{self.hf_module}.lora_B.weight"


def _targets_of(lora_config: Any) -> set[str] | str:
    targets = lora_config.target_modules
    if targets is None:
        raise LoraError("LoraConfig.target_modules is empty: name the HF modules to adapt (e.g. ['q_proj', 'v_proj'])")
    if isinstance(targets, str):
        return targets  # "all-linear" or a regular expression over module names (peft's rules)
    return set(targets)


def _selected(hf_module: str, targets) -> bool:
    """peft's match (``check_target_module_exists``): a regular expression over the whole module name
    (or ``all-linear``), else a list entry equal to the name or to a dotted suffix of it (``qkv``,
    ``attn.proj``, ``mlp.0``)."""
    if isinstance(targets, str):
        import re

        return targets == "all-linear" or re.fullmatch(targets, hf_module) is not None
    return hf_module in targets or any(hf_module.endswith("." + t) for t in targets)


def _same(name: str) -> str:
    return name


def lora_targets(cfg, weight_map, lora_config: Any, shapes: dict, layers=None,
                 module_name: Callable[[str], str] = _same) -> list[LoraTarget]:
    """The adapted modules of ``layers`` (default: all) and of the vision tower, if any; LoraError for
    targets the architecture lacks. ``module_name``: a weight-map HF name as transformers' model names it
    (``Architecture.module_name``; Qwen2-VL's weight map keeps the release names ``model.layers.*`` and
    ``visual.*``, its transformers model says ``model.language_model.layers.*`` and ``model.visual.*``):
    target regular expressions match it and adapter files carry it, as peft's."""
    r = int(lora_config.r)
    targets = _targets_of(lora_config)
    entries = weight_map.entries(range(cfg.num_hidden_layers) if layers is None else layers, first=False, last=False)
    modules: list[str] = []  # every linear module a target may name (for the unknown-target check)
    found: list[LoraTarget] = []
    for entry in entries:
        if entry.experts:  # expert 0's parts stand for every expert
            for hf_name in entry.hf[:len(entry.rules)]:
                hf_module = module_name(hf_name)[: -len(".weight")]
                _refuse_unadapted(hf_module.rsplit(".", 1)[1], hf_module, targets, True)
            continue
        found += _entry_targets(entry, shapes, targets, r, module_name, modules, tower=False)
    for entry in weight_map.entries((), first=True, last=False):  # the vision tower (text models: the embedding)
        found += _entry_targets(entry, shapes, targets, r, module_name, modules, tower=True)
    if isinstance(targets, set):
        unknown = sorted(t for t in targets if not any(m == t or m.endswith("." + t) for m in modules))
        if unknown:
            leaves = sorted({m.rsplit(".", 1)[1] for m in modules})
            raise LoraError(f"LoRA target module(s) {', '.join(unknown)} not in this architecture "
                            f"(its linear modules: {', '.join(leaves)})")
    if not found:
        raise LoraError(f"LoRA target_modules={lora_config.target_modules!r} matches no module")
    return found


def _entry_targets(entry, shapes: dict, targets, r: int, module_name: Callable[[str], str], modules: list[str],
                   tower: bool) -> list[LoraTarget]:
    """The selected linear modules of one weight-map entry (several when it packs projections), with their
    A/B rules from the entry's: column-parallel (``Split(0)``, ``KVHeads``, ``Blocks``, ``Groups``, the
    tower's fused ``qkv``: ``Fused(3)``, per q/k/v block then per head) -> B takes the rule, A whole;
    row-parallel (``Split(1)``) -> A takes it, B whole. Linear modules the model cannot adapt are refused
    by name when selected; embeddings and convolutions are not linear modules (peft's ``all-linear``)."""
    if not entry.param.endswith(".weight"):
        return []
    layer = entry.param[: -len(".weight")]
    packed = tuple((hf_name[: -len(".weight")].rsplit(".", 1)[1], shapes[hf_name][0])
                   for hf_name in entry.hf[:len(entry.rules)])
    found = []
    for hf_name, rule in zip(entry.hf, entry.rules):
        hf_module = module_name(hf_name)[: -len(".weight")]
        leaf = hf_module.rsplit(".", 1)[1]
        shape = shapes[hf_name]
        if tower and (len(shape) != 2 or "embed" in leaf):  # embeddings, the tower's position table, its Conv3d
            if len(shape) == 1 or targets == "all-linear" or not _selected(hf_module, targets):
                continue
            if len(shape) == 5 and isinstance(rule, Replicated):  # the patch embedding: peft's Conv3d LoRA
                modules.append(hf_module)
                found.append(LoraTarget(layer, hf_module, leaf, False, rule, rule, (r, *shape[1:]),
                                        (shape[0], r, 1, 1, 1)))
                continue
            kind = "an embedding" if len(shape) == 2 else f"a {len(shape)}-D weight"
            raise LoraError(f"LoRA target_modules selects {hf_module} ({kind}): LoRA on it is not built "
                            f"(adapt linear modules)")
        # Blocks: row blocks each split over TP (Gated DeltaNet's in_proj_qkv); Groups: Qwen3-Next's
        # interleaved in_proj_qkvz / in_proj_ba, each rank's key-head groups; B takes the same rows
        column = isinstance(rule, (KVHeads, Blocks, Groups, Fused)) or (isinstance(rule, Split) and rule.dim == 0)
        row = isinstance(rule, Split) and rule.dim == 1
        if not (column or row):
            if len(shape) == 2:  # a linear module held whole: MoE router, shared-expert gate
                _refuse_unadapted(leaf, hf_module, targets, False)
            continue
        if len(shape) != 2:  # a convolution (Gated DeltaNet's conv1d): not a linear module
            continue
        modules.append(hf_module)
        if not _selected(hf_module, targets):
            continue
        out_f, in_f = shape
        found.append(LoraTarget(layer, hf_module, leaf, column,
                                Replicated() if column else Split(1), rule if column else Replicated(),
                                (r, in_f), (out_f, r), packed))
    return found


def _refuse_unadapted(leaf: str, hf_module: str, targets, expert: bool) -> None:
    """LoRA on a mixture-of-experts router or expert is not built: refuse a target that selects one
    (peft adapts them: ``gate_proj``/``up_proj``/``down_proj`` reach transformers' fused experts
    ``mlp.experts``, ``all-linear`` the router ``mlp.gate`` too), naming the module."""
    names = [(leaf, hf_module)]
    if expert:  # model.layers.{i}.mlp.experts.{e}.gate_proj -> the fused module model.layers.{i}.mlp.experts
        names.append(("experts", hf_module.rsplit(".", 2)[0]))
    for name, module in names:
        if _selected(module, targets):
            raise LoraError(f"LoRA target {name!r} selects {module}: LoRA on mixture-of-experts "
                            f"{'experts' if expert else 'routers and gates'} is not supported (adapt the "
                            f"attention projections q_proj/k_proj/v_proj/o_proj)")


# LoraConfig fields whose non-default values would change the model in ways not built here.
_UNSUPPORTED = {"alpha_pattern": {}, "rank_pattern": {}, "use_dora": False, "modules_to_save": None,
                "layers_to_transform": None, "layers_pattern": None, "exclude_modules": None, "lora_bias": False,
                "target_parameters": None}


def check_lora_config(cfg, weight_map, lora_config: Any, pconfig, shapes: dict,
                      module_name: Callable[[str], str] = _same) -> list[LoraTarget]:
    """Everything that can be refused before any process group exists (``module_name``: ``lora_targets``')."""
    if int(lora_config.r) < 1:
        raise LoraError(f"LoRA r={lora_config.r} must be positive")
    if getattr(lora_config, "bias", "none") != "none":
        raise LoraError(f"LoRA bias={lora_config.bias!r} is not supported (only 'none')")
    for name, default in _UNSUPPORTED.items():
        value = getattr(lora_config, name, default)
        if value not in (default, None, {}, [], False):
            raise LoraError(f"LoraConfig.{name}={value!r} is not supported here")
    if getattr(lora_config, "init_lora_weights", True) is not True:
        raise LoraError(f"LoraConfig.init_lora_weights={lora_config.init_lora_weights!r} is not supported "
                        f"(only peft's default Kaiming-uniform A, zero B)")
    if float(getattr(lora_config, "lora_dropout", 0.0) or 0.0) > 0 and pconfig.tp > 1 and not pconfig.sequence_parallel:
        raise ParallelConfigError(f"lora_dropout={lora_config.lora_dropout} with tp={pconfig.tp} needs "
                                  f"sequence_parallel=True (each rank then drops out only its own tokens; "
                                  f"without SP the TP ranks' masks would differ on the same tokens)")
    targets = lora_targets(cfg, weight_map, lora_config, shapes, module_name=module_name)
    tower = [t.hf_module for t in targets if not _in_decoder(t.layer)]
    if tower and float(getattr(lora_config, "lora_dropout", 0.0) or 0.0) > 0 and pconfig.tp > 1:
        raise ParallelConfigError(f"lora_dropout={lora_config.lora_dropout} with tp={pconfig.tp} on the vision "
                                  f"tower ({tower[0]}): its activations are whole on every TP rank, whose dropout "
                                  f"masks would differ; use lora_dropout=0 or tp=1")
    replicated = {t.leaf for t in targets if isinstance(t.b_rule, KVHeads) and t.b_rule.replicas(pconfig.tp) > 1}
    if replicated:
        raise ParallelConfigError(f"LoRA on {', '.join(sorted(replicated))} with tp={pconfig.tp} > "
                                  f"num_key_value_heads={cfg.num_key_value_heads} (replicated KV heads) "
                                  f"is not supported")
    return targets


def scaling(lora_config: Any) -> float:
    r = int(lora_config.r)
    return float(lora_config.lora_alpha) / (math.sqrt(r) if getattr(lora_config, "use_rslora", False) else r)


def _init_a(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """peft's A init (Kaiming uniform, a = sqrt(5)) of the full tensor, from the seed and the name."""
    import hashlib

    digest = hashlib.sha256(f"lora:{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    # kaiming_uniform_(a=sqrt(5)): gain sqrt(2/6), bound gain*sqrt(3/fan_in); fan_in: a convolution's in*kernel
    bound = 1.0 / math.sqrt(math.prod(shape[1:]))
    return (torch.rand(shape, generator=gen) * 2 - 1) * bound


def apply_lora(model, lora_config: Any, targets: list[LoraTarget], seed: int = 0) -> None:
    """Add the LoRA modules of this rank's layers, initialise them as peft does, freeze the base."""
    groups = model.groups
    mine = set(model.layer_ids())
    by_layer: dict[str, list[LoraTarget]] = {}
    for t in targets:
        if (int(t.layer.split(".")[2]) in mine) if _in_decoder(t.layer) else model.visual is not None:
            by_layer.setdefault(t.layer, []).append(t)
    for p in model.parameters():
        p.requires_grad_(False)
    s, dropout = scaling(lora_config), float(getattr(lora_config, "lora_dropout", 0.0) or 0.0)
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    for layer_name, layer_targets in by_layer.items():
        layer = model.get_submodule(layer_name)
        if len(layer_targets[0].a_shape) > 2:  # the tower's patch embedding (a Conv3d), whole on every rank
            t = layer_targets[0]
            layer.lora = PatchLoRA(t.leaf, t.a_shape, t.b_shape, scaling=s, dropout=dropout, dtype=dtype,
                                   device=device)
        elif layer_targets[0].column:
            leaves = {t.leaf: t for t in layer_targets}
            parts = _packed_parts(layer, layer_targets[0])
            layer.lora = ColumnLoRA(layer.in_features,
                                    [(leaf if leaf in leaves else None, rows) for leaf, rows in parts],
                                    r=int(lora_config.r), scaling=s, dropout=dropout, tp_group=groups.tp_group,
                                    sequence_parallel=layer.sequence_parallel, dtype=dtype, device=device)
        else:
            t = layer_targets[0]
            layer.lora = RowLoRA(t.leaf, layer.weight.shape[1], layer.out_features, r=int(lora_config.r), scaling=s,
                                 dropout=dropout, tp_group=groups.tp_group, sequence_parallel=layer.sequence_parallel,
                                 dtype=dtype, device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for t in targets:
            if t.a_param in params:
                full = _init_a(t.hf_module, t.a_shape, seed)
                params[t.a_param].copy_(t.a_rule.split(full, groups.tp_rank, groups.tp_size))
    model.lora_config, model.lora_targets = lora_config, [t for t in targets if t.a_param in params]
    model.all_lora_targets = targets  # every stage's (adapter files hold all of them)


def _in_decoder(layer: str) -> bool:
    """A decoder layer's module (``model.layers.N...``), not the vision tower's (``visual.*``: on the first
    pipeline stage, with the embedding)."""
    return layer.startswith("model.layers.")


def _packed_parts(layer, target: LoraTarget) -> list[tuple[str, int]]:
    """(HF leaf, local rows) of each projection packed in a column-parallel layer, in order."""
    prefix = target.hf_module.rsplit(".", 1)[0]
    if hasattr(layer, "local_sizes"):  # packed q/k/v
        q, k, v = layer.local_sizes()
        return [("q_proj", q), ("k_proj", k), ("v_proj", v)] if prefix.endswith("self_attn") else []
    if len(target.packed) > 1:  # packed projections (gate/up, Gated DeltaNet's qkv/z and b/a), each split evenly
        full = sum(rows for _, rows in target.packed)
        return [(leaf, rows * layer.weight.shape[0] // full) for leaf, rows in target.packed]
    return [(target.leaf, layer.weight.shape[0])]


class MergedParameters(dict):
    """Internal name -> this rank's tensor with ``scaling * B A`` added to each adapted weight,
    computed when read (one merged weight alive at a time; FSDP2 shards un-sharded on access, so
    readers must read in the same order on every rank - the export plan's order)."""

    def __init__(self, model) -> None:
        super().__init__((n, p) for n, p in model.named_parameters() if ".lora." not in n)
        self.model = model
        self.adapted = {f"{t.layer}.weight": t.layer for t in model.lora_targets}

    def __getitem__(self, name: str) -> torch.Tensor:
        base = unshard(super().__getitem__(name)).detach()
        if name not in self.adapted:
            return base
        return _merge_layer(self.model, self.adapted[name], base)


def _merge_layer(model, layer_name: str, base: torch.Tensor) -> torch.Tensor:
    s = scaling(model.lora_config)
    layer = model.get_submodule(layer_name)
    weight = base.clone()
    lora = layer.lora
    if isinstance(lora, ColumnLoRA):
        row = 0
        for leaf, rows in lora.parts:
            if leaf is not None:
                a = unshard(getattr(lora, f"lora_A_{leaf}")).detach()
                b = unshard(getattr(lora, f"lora_B_{leaf}")).detach()
                weight[row:row + rows] += s * (b @ a)
            row += rows
    else:  # RowLoRA; PatchLoRA: convolution kernels, flattened (B is 1x1x1)
        a = unshard(getattr(lora, f"lora_A_{lora.name}")).detach()
        b = unshard(getattr(lora, f"lora_B_{lora.name}")).detach()
        weight += s * (b.flatten(1) @ a.flatten(1)).view(weight.shape)
    return weight
