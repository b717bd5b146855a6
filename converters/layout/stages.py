"""Where things live in a Megatron checkpoint: pipeline stages, virtual chunks, stage-local layer
keys, Transformer-Engine norm names, torch_dist's stacked keys, the iteration folder.

Torch-free, and the one copy of these facts: shared by the format readers
(``converters/formats/megatron_legacy``, ``megatron_dist``), the torch path's writers and the copy
path's planners.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from converters.layout.model import EMBED, FINAL, Unit
from models.common.errors import CheckpointError
from models.common.weight_map import WeightEntry
from parallel.config import ParallelConfig, ParallelConfigError
from parallel.pipeline_layout import stage_layer_ranges

RANK_FILE = "model_optim_rng.pt"
# Megatron-LM saves an (empty) extra state for every linear layer; its strict load expects it.
LINEAR_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
# The Transformer-Engine spec keeps the norms inside the following linear layers (local name -> TE name).
# Which layers store which norm under which name (``norm_aliases``): megatron-core's TE spec
# (``get_gpt_layer_with_transformer_engine_submodules``) fuses the input norm into ``linear_qkv`` in every
# layer and the pre-MLP norm into ``linear_fc1`` in dense layers only: a MoE layer has no ``linear_fc1``
# and keeps its ``pre_mlp_layernorm`` module. Its local spec names both norms by module in legacy files
# and maps both to the fused names in every layer, MoE ones included, in torch_dist
# (``sharded_state_dict_keys_map``). Readers take either name; writers use ``norm_aliases``.
TE_NORM_ALIASES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                   "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
TRANSFORMER_ENGINE, LOCAL_SPEC = "transformer_engine", "local"  # Megatron-LM's --transformer-impl values
LAYER_PREFIX = "decoder.layers."
DIST_DATA_FILES = 4  # torch_dist output: __0_0.distcp .. __3_0.distcp, units dealt round-robin
DIST_METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                      "common_backend_version": 1}


FIRST_FLAG, LAST_FLAG = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"

# what each --to writes, in a user's words (messages and the closing ``wrote ...`` line)
TARGET_NAMES = {"hf": "HF safetensors", "megatron": "Megatron legacy torch",
                "megatron-dist": "megatron-core torch_dist", "megatron-bridge": "Megatron-Bridge torch_dist",
                "vllm": "vLLM sharded_state"}


def checkpoint_layout(fmt: str, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int | None = None,
                      first: int | None = None, last: int | None = None) -> str:
    """A checkpoint's layout in a user's words, e.g. ``Megatron legacy torch, tp=2 pp=2 vpp=1 ep=1``
    (vLLM: tp/pp; HF: none; ``ep`` None: not shown). Not ``ParallelConfig.describe()``, which
    describes a training run (its ``sp=``, ``cp=`` mean nothing for files on disk)."""
    name = TARGET_NAMES.get(fmt, fmt)
    if fmt == "hf":
        return name
    parts = [f"tp={tp}", f"pp={pp}"]
    if fmt != "vllm":
        parts += [f"vpp={vpp}"] + ([f"ep={ep}"] if ep is not None else [])
    parts += [f"{side} stage {n} layers" for side, n in (("first", first), ("last", last)) if n is not None]
    return f"{name}, {' '.join(parts)}"


def validate_target_layout(cfg: Any, fmt: str, *, tp: int, pp: int, vpp: int, first: int | None = None,
                           last: int | None = None) -> None:
    """The layout checks of ``ParallelConfig.validate`` for a ``--to fmt`` target, their reasons
    under the checkpoint layout (``checkpoint_layout``) instead of a training run's description."""
    import re

    pconfig = ParallelConfig(tp=tp, pp=pp, vpp=vpp, num_layers_in_first_pipeline_stage=first,
                             num_layers_in_last_pipeline_stage=last)
    try:
        pconfig.validate(cfg)
    except ParallelConfigError as exc:
        reason = re.sub(r"^invalid parallel layout \(?" + re.escape(pconfig.describe()) + r"\)?:\s*", "", str(exc))
        reason = re.sub(r"\s*\bsp=(on|off)\b", "", reason)
        raise ParallelConfigError(f"target layout {checkpoint_layout(fmt, tp, pp, vpp, None, first, last)}: "
                                  f"{reason}") from None
    if fmt == "megatron-bridge" and cfg.vocab_size % tp:
        # Megatron-Bridge builds models from HF configs with should_pad_vocab=False (training/setup.py pads only a
        # vocabulary taken from the tokenizer): the embedding and output layer keep the HF vocabulary, which
        # megatron-core's VocabParallelEmbedding divides by tp (an assertion when the model is built)
        divisors = [n for n in range(2, min(cfg.vocab_size, 64) + 1) if cfg.vocab_size % n == 0]
        raise ParallelConfigError(
            f"target layout {checkpoint_layout(fmt, tp, pp, vpp, None, first, last)}: vocab_size={cfg.vocab_size} "
            f"is not divisible by tp={tp} (Megatron-Bridge keeps the HF vocabulary unpadded: should_pad_vocab="
            f"False); --tp 1 or one that divides it ({', '.join(map(str, divisors)) or 'none up to 64'})")


def check_target_stages(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None) -> None:
    """A target pipeline split that exists, else ParallelConfigError in pmz's own terms: why, the
    ``--pp`` values that split ``num_layers`` evenly (at this ``--vpp``), and the flags that give an
    uneven split (Megatron's ``decoder_first/last_pipeline_num_layers``)."""
    try:
        stage_layer_ranges(num_layers, ParallelConfig(pp=pp, vpp=vpp, num_layers_in_first_pipeline_stage=first,
                                                      num_layers_in_last_pipeline_stage=last))
    except ParallelConfigError as exc:
        reason = str(exc).split("; set num_layers_in_first")[0]
        even = []
        for p in range(1, num_layers + 1):
            try:
                stage_layer_ranges(num_layers, ParallelConfig(pp=p, vpp=vpp))
                even.append(p)
            except ParallelConfigError:
                continue
        with_vpp = f" with --vpp {vpp}" if vpp > 1 else ""
        uneven = "" if first or last else f"; or an uneven split: {FIRST_FLAG} N and/or {LAST_FLAG} N (with --vpp 1)"
        raise ParallelConfigError(f"--pp {pp}{with_vpp}: {reason}; even splits of {num_layers} layers: --pp "
                                  f"{', '.join(map(str, even)) or 'none'}{with_vpp}{uneven}") from None


class MegatronLayout:
    """Where each global layer lives for a (pp, vpp, uneven) layout."""

    def __init__(self, num_layers: int, pp: int, vpp: int, first: int | None, last: int | None, where: str) -> None:
        try:
            pconfig = ParallelConfig(pp=pp, vpp=vpp, num_layers_in_first_pipeline_stage=first,
                                     num_layers_in_last_pipeline_stage=last)
            self.ranges = stage_layer_ranges(num_layers, pconfig)
        except ParallelConfigError as exc:
            raise CheckpointError(f"{where}: {exc}") from exc
        self.pp, self.vpp = pp, vpp
        self.where: dict[int, tuple[int, int, int]] = {}
        for p, chunks in enumerate(self.ranges):
            for v, layers in enumerate(chunks):
                for j, i in enumerate(layers):
                    self.where[i] = (p, v, j)

    def unit_location(self, unit: Unit) -> tuple[int, int]:
        """(pp rank, chunk) holding a unit."""
        if unit == EMBED:
            return 0, 0
        if unit == FINAL:
            return self.pp - 1, self.vpp - 1
        p, v, _ = self.where[int(unit)]
        return p, v

    def stage_units(self, p: int, v: int) -> list[tuple[Unit, int | None]]:
        """(unit, stage-local layer index or None) held by chunk ``v`` of stage ``p``, in order."""
        units: list[tuple[Unit, int | None]] = []
        if p == 0 and v == 0:
            units.append((EMBED, None))
        units += [(i, j) for j, i in enumerate(self.ranges[p][v])]
        if p == self.pp - 1 and v == self.vpp - 1:
            units.append((FINAL, None))
        return units


def unit_megatron_keys(reader_wmap, unit: Unit, local_index: int | None) -> list[tuple[WeightEntry, str]]:
    """(entry with global HF names, Megatron key with the stage-local layer number) for a unit
    (experts numbered globally: the layout of an EP=1 checkpoint)."""
    return [(e, k) for e, k, _ in unit_megatron_keys_ep(reader_wmap, unit, local_index, 1)]


def not_in_megatron(templates) -> set[str]:
    """HF-side parameters of a layer that Megatron does not store: the shared expert of a Qwen2-MoE
    model without one (transformers keeps 0-row tensors and a gate whose output is multiplied by
    zero; megatron-core builds no shared_experts module, so its gate is not stored either)."""
    shared = [t for t in templates if t.megatron and ".shared_experts." in t.megatron]
    if any(t.shapes is not None and any(0 in s for s in t.shapes) for t in shared):
        return {t.param for t in shared}
    return set()


def stores_shared_expert(templates) -> bool:
    """Whether Megatron stores a shared expert for these layer templates (Qwen3-MoE has none at all;
    Qwen2-MoE of width 0 has none in Megatron)."""
    return any(t.megatron and ".shared_experts." in t.megatron for t in templates) and not not_in_megatron(templates)


def unit_megatron_keys_ep(reader_wmap, unit: Unit, local_index: int | None,
                          ep: int) -> list[tuple[WeightEntry, str, int | None]]:
    """(entry, legacy Megatron key, EP rank holding it or None) for a unit at expert parallelism ``ep``.

    Expert entries become one plain entry per global expert e (its HF names; ``entry.megatron``
    with the global id) whose key names the stage-local layer and the local expert id
    ``e % (E/ep)`` in the file of EP rank ``e // (E/ep)``. Shared-expert entries of width 0 (no
    shared expert) have no Megatron tensor and are left out."""
    if unit == EMBED:
        return [(e, e.megatron, None) for e in reader_wmap.first_entries]
    if unit == FINAL:
        return [(e, e.megatron, None) for e in reader_wmap.last_entries]
    out: list[tuple[WeightEntry, str, int | None]] = []
    templates = reader_wmap.layer_templates(int(unit))
    skipped = not_in_megatron(templates)
    for t in templates:
        if t.param in skipped:
            continue
        if not t.experts:
            out.append((t.format(int(unit)), t.megatron.format(i=local_index), None))
            continue
        per_rank = t.experts // ep
        formatted = t.format(int(unit))
        for e in range(t.experts):
            key = t.megatron.replace("{i}", str(local_index)).replace("{e}", str(e % per_rank))
            out.append((formatted.expert(e), key, e // per_rank))
    return out


def absent_tensors(reader_wmap, unit: Unit) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of the tensors of a unit that Megatron does not store (``not_in_megatron``);
    readers of Megatron checkpoints give them as zeros."""
    if unit in (EMBED, FINAL):
        return {}
    out = {}
    templates = reader_wmap.layer_templates(int(unit))
    skipped = not_in_megatron(templates)
    for t in templates:
        if t.param in skipped:
            entry = t.format(int(unit))
            out.update((name, tuple(entry.shapes[j % entry.parts])) for j, name in enumerate(entry.hf))
    return out


def extra_state_modules(unit: Unit, local_index: int | None, wmap: Any = None, ep: int = 1,
                        ep_rank: int = 0, experts: str = "sequential", te_norms: bool = False) -> list[str]:
    """Modules whose (empty) ``_extra_state`` a Megatron-LM rank file holds for this unit (MoE
    layers: attention, this EP rank's local experts and the shared expert, as megatron-core writes;
    ``experts`` is the expert module (``converters/layout/experts``): GroupedMLP keeps none). ``te_norms``
    (``writes_te_norms``): also the Transformer-Engine norms that are modules of their own (``te_norm_modules``)."""
    if isinstance(unit, int):  # (Bridge's Qwen3VLModel: under language_model.)
        prefix = f"{LAYER_PREFIX if wmap is None else layer_prefix(wmap)}{local_index}."
        norms = [prefix + m for m in te_norm_modules(wmap, unit)] if te_norms and wmap is not None else []
        if wmap is None or unit not in wmap.moe_layers:
            return [prefix + m for m in LINEAR_MODULES] + norms
        modules = [prefix + m for m in LINEAR_MODULES[:2]] + norms
        local = next((t.experts for t in wmap.moe_layer_entries if t.experts), 0) // ep
        if experts == "sequential":
            modules += [f"{prefix}mlp.experts.local_experts.{i}.linear_fc{j}" for i in range(local) for j in (1, 2)]
        if stores_shared_expert(wmap.moe_layer_entries):
            modules += [f"{prefix}mlp.shared_experts.linear_fc{j}" for j in (1, 2)]
        return modules
    head = "" if wmap is None else layer_prefix(wmap)[:-len(LAYER_PREFIX)]  # language_model. in Bridge's VL models
    if unit != FINAL:
        return []
    return [head + "output_layer"] + ([head + FINAL_NORM] if te_norms else [])


def chunk_state(data: Any, chunk: int, vpp: int, path: Path) -> dict:
    """The state dict of virtual chunk ``chunk`` in a legacy rank file (``model`` or ``model{v}``)."""
    key = "model" if vpp == 1 else f"model{chunk}"
    state = data.get(key) if isinstance(data, dict) else None
    if state is None and vpp == 1 and isinstance(data, dict):
        state = data.get("model0")
    if not isinstance(state, dict):
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(f"{path}: no '{key}' state dict (keys: {found})")
    return state


def norm_aliases(moe_layer: bool, impl: str, fmt: str) -> dict[str, str]:
    """The norms a layer stores under the fused linear's name (a part of ``TE_NORM_ALIASES``) in a
    checkpoint of ``fmt`` ("torch" legacy or "torch_dist") written for the ``impl`` layer spec
    (``TRANSFORMER_ENGINE`` or ``LOCAL_SPEC``); see ``TE_NORM_ALIASES``."""
    if impl == TRANSFORMER_ENGINE:
        return {local: te for local, te in TE_NORM_ALIASES.items()
                if not (moe_layer and local == "pre_mlp_layernorm.weight")}
    return dict(TE_NORM_ALIASES) if fmt == "torch_dist" else {}


def target_impl(*, bridge: bool, args: Any) -> str:
    """The layer spec a checkpoint we write is for: Megatron-Bridge builds the TE spec (its default layer spec;
    the run_config.yaml we write names no other); a Megatron-LM checkpoint the spec its args declare
    (``transformer_impl``; ``args`` a Namespace, or the copy path's dict of fields)."""
    if bridge:
        return TRANSFORMER_ENGINE
    impl = args.get("transformer_impl") if isinstance(args, dict) else getattr(args, "transformer_impl", None)
    return impl or LOCAL_SPEC


def writes_te_norms(*, bridge: bool, args: Any) -> bool:
    """Whether a checkpoint we write holds the (empty) ``_extra_state`` of the Transformer-Engine norms that are
    modules of their own (``te_norm_modules``; the block's ``final_layernorm``): exactly for the TE spec
    (``target_impl``), torch_dist and legacy alike, every model family (the Gated DeltaNet hybrids list all
    their TE modules in ``layout.hybrid``). megatron-core builds them as ``TENorm`` (te.pytorch.RMSNorm, whose
    ``get_extra_state`` is overridden), so a strict load refuses a checkpoint without; its local spec's norms
    keep none (a legacy strict load would refuse them as unexpected)."""
    return target_impl(bridge=bridge, args=args) == TRANSFORMER_ENGINE


def writer_norm_aliases(wmap: Any, layer: int, *, bridge: bool, args: Any, fmt: str) -> dict[str, str]:
    """``norm_aliases`` of a layer we write, for the spec ``target_impl`` names."""
    return norm_aliases(layer in wmap.moe_layers, target_impl(bridge=bridge, args=args), fmt)


def lookup_key(state: dict, key: str) -> tuple[str, Any]:
    """(key found, ``state`` value or None) for ``key``, also under its Transformer-Engine name."""
    if key in state:
        return key, state[key]
    for local, te in TE_NORM_ALIASES.items():
        alt = key[: -len(local)] + te
        if key.endswith(local) and alt in state:
            return alt, state[alt]
    return key, None


def stacked_key(template: str, aliases: dict[str, str] = TE_NORM_ALIASES) -> str:
    """``decoder.layers.{i}.x.weight`` -> torch_dist's stacked ``decoder.layers.x.weight`` (the norms in
    ``aliases`` under their Transformer-Engine names: ``norm_aliases``); a prefix before ``decoder.``
    (Megatron-Bridge's ``language_model.``) is kept."""
    key = template.replace("layers.{i}.", "layers.")
    head, sep, local = key.partition(LAYER_PREFIX)
    if sep and local in aliases:
        return head + LAYER_PREFIX + aliases[local]
    return key


def layer_prefix(wmap: Any) -> str:
    """Where a weight map's decoder layers are in Megatron names: ``decoder.layers.`` or, for
    Megatron-Bridge's vision-language models, ``language_model.decoder.layers.``."""
    for entry in wmap.layer_entries:
        if entry.megatron and LAYER_PREFIX in entry.megatron:
            return entry.megatron.split(LAYER_PREFIX, 1)[0] + LAYER_PREFIX
    return LAYER_PREFIX


def dist_key(template: str, layer: int | None, tensors: dict) -> tuple[str, int | None]:
    """(torch_dist key, index along the stacked layer dim or None) of a weight-map Megatron name:
    per-layer keys when the checkpoint was saved without layer stacking."""
    if layer is None:
        return template, None
    per_layer = template.format(i=layer)
    if per_layer in tensors:
        return per_layer, None
    stacked = stacked_key(template)
    # unstacked checkpoints (mixed dense and MoE layers) keep the norms under their TE names too
    te_per_layer = stacked.replace(LAYER_PREFIX, f"{LAYER_PREFIX}{layer}.", 1)
    if te_per_layer in tensors:
        return te_per_layer, None
    # a MoE layer's pre-MLP norm: the TE spec keeps its own name (``norm_aliases``), megatron-core's local
    # spec the fused one
    unfused = stacked_key(template, {})
    if stacked not in tensors and unfused in tensors:
        return unfused, layer
    return stacked, layer


# ------------------------------------------------ torch_dist keys of MoE layers (both paths' writers)
# a legacy expert key's local expert number (``mlp.experts.local_experts.{i}.``)
LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def stacks_layers(wmap: Any, num_layers: int) -> bool:
    """Whether megatron-core stacks this model's layers (uniform layers: all MoE, or none)."""
    return not wmap.has_experts or len(wmap.moe_layers) == num_layers


# the block's final norm under a layer prefix's block (``decoder.``): ``TENorm`` in a TE-spec model (megatron-core's
# TransformerBlock takes ``LayerNormImpl`` for a layer spec, or the TE block spec's ``TENorm``)
FINAL_NORM = "decoder.final_layernorm"


def te_norm_modules(wmap: Any, layer: int) -> list[str]:
    """A layer's Transformer-Engine norms that are modules of their own in megatron-core's TE GPT spec
    (``get_gpt_layer_with_transformer_engine_submodules``: ``backend.layer_norm()``, TENorm): the q/k
    ``layernorm`` (Qwen3's qk-norm) and a MoE layer's ``pre_mlp_layernorm`` (no ``linear_fc1`` to fuse it into);
    the input norm and a dense layer's pre-MLP norm live in their linear's state."""
    names = [t.megatron for t in wmap.layer_templates(layer) if t.megatron]
    modules = [m for m in ("self_attention.q_layernorm", "self_attention.k_layernorm")
               if any(n.endswith(f".{m}.weight") for n in names)]
    if layer in wmap.moe_layers:
        modules.append("pre_mlp_layernorm")
    return modules


def te_norm_extra_states(wmap: Any, layer: int, *, num_layers: int, stacked: bool,
                         prefix: str) -> list[tuple[str, str]]:
    """(module, shard suffix) of the empty torch_dist ``_extra_state`` items of a layer's ``te_norm_modules``
    (written where ``writes_te_norms``)."""
    head = prefix if stacked else f"{prefix}{layer}."
    where = f"shard_{layer}_{num_layers}" if stacked else "shard_0_1"
    return [(head + m, where) for m in te_norm_modules(wmap, layer)]


def final_norm_extra_states(prefix: str) -> list[tuple[str, str]]:
    """(module, shard suffix) of the block's final norm's empty torch_dist ``_extra_state`` (``FINAL_NORM``,
    written where ``writes_te_norms``)."""
    return [(prefix[:-len(LAYER_PREFIX)] + FINAL_NORM, "shard_0_1")]


def layer_extra_states(wmap: Any, layer: int, *, num_layers: int, experts: int, stacked: bool,
                      prefix: str) -> list[tuple[str, str]]:
    """(module, shard suffix) of the empty ``_extra_state`` items megatron-core writes for a layer:
    ``shard_{layer}_{L}`` stacked, ``shard_0_1`` per layer; expert linears ``shard_{layer}.{e}_{L}.{E}``
    stacked, ``shard_{e}_{E}`` per layer; the shared expert's linears where Megatron stores one."""
    head = prefix if stacked else f"{prefix}{layer}."
    where = f"shard_{layer}_{num_layers}" if stacked else "shard_0_1"
    if layer not in wmap.moe_layers:
        return [(head + m, where) for m in LINEAR_MODULES]
    out = [(head + m, where) for m in LINEAR_MODULES[:2]]
    for j in (1, 2):
        out += [(f"{head}mlp.experts.experts.linear_fc{j}",
                 f"shard_{layer}.{e}_{num_layers}.{experts}" if stacked else f"shard_{e}_{experts}")
                for e in range(experts)]
    if stores_shared_expert(wmap.moe_layer_entries):
        out += [(f"{head}mlp.shared_experts.linear_fc{j}", where) for j in (1, 2)]
    return out
