"""The model side of a checkpoint, torch-free: which architecture an HF config names, its model
config and conversion weight map, and the units conversions move one at a time.

A *unit* is the embedding (``EMBED``), one decoder layer (its global index) or the final norm and
output layer (``FINAL``; with a Gated DeltaNet hybrid's MTP block, that too: it lives on the last
pipeline stage). Readers turn their format into the HF tensors of a unit; writers consume
units. Peak memory is therefore a few units, whatever the model size.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Union

from models.common.errors import CheckpointError
from models.common.weight_map import PLAIN, WeightEntry, WeightMap

if TYPE_CHECKING:
    from models.common.architecture import Architecture
    from models.common.config import ModelConfig

EMBED = "embed"
FINAL = "final"
Unit = Union[int, str]


# The registered architectures: the model folders (``models/<name>/architecture.py``, its ``ARCHITECTURE``), each
# named after the HF model_type it reads or a prefix of them (``qwen3_5`` reads ``qwen3_5_text`` too).
ARCHITECTURE_PACKAGES = ("llama", "qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl", "qwen3", "qwen3_moe", "qwen3_5",
                         "qwen3_5_moe", "qwen3_next", "qwen3_vl", "qwen3_vl_moe")


def _architecture(package: str) -> Architecture:
    return importlib.import_module(f"models.{package}.architecture").ARCHITECTURE


def architectures() -> dict[str, Architecture]:
    """Registered architectures by HF model_type (imports every model folder's plain-data modules)."""
    return {t: arch for arch in map(_architecture, ARCHITECTURE_PACKAGES) for t in arch.hf_model_types}


# Megatron-Bridge's vision-language models (``Qwen25VLModel``) hold megatron-core's GPTModel as
# ``language_model`` and transformers' own vision tower as ``visual``: their torch_dist keys are the text
# model's Megatron names under this prefix and the tower's HF names unchanged.
BRIDGE_TEXT_PREFIX = "language_model."
BRIDGE_TARGET = "--to megatron-bridge"


# Vision-language architectures with no Megatron layout in pmz at all (why, in the refusal's words); none today:
# Qwen3-VL and Qwen3-VL-MoE have Megatron-Bridge's Qwen3VLModel layout (``bridge_qwen3_vl_weight_map``)
NO_MEGATRON_LAYOUT: dict[str, str] = {}
NO_MEGATRON_HINT = "convert it with --to hf or --to vllm"
# Megatron-Bridge's Qwen3VLModel (``qwen3_vl_bridge.py``): text GPT under language_model., megatron-core's ViT under
# vision_model. (DeepStack mergers included), in every Megatron format
QWEN3_VL_MEGATRON = ("qwen3_vl", "qwen3_vl_moe")


def no_megatron_layout(architecture: str) -> str:
    """The refusal of an architecture without a Megatron layout (``NO_MEGATRON_LAYOUT``), one line."""
    return (f"{architecture} has no Megatron layout in pmz (--to megatron, megatron-dist, megatron-bridge): "
            f"Megatron-LM's formats have no names for its vision tower and {NO_MEGATRON_LAYOUT[architecture]}; "
            f"{NO_MEGATRON_HINT}")


def is_qwen3_vl(cfg: ModelConfig) -> bool:
    """Qwen3-VL / Qwen3-VL-MoE: Megatron-Bridge's ``Qwen3VLModel`` in every Megatron format."""
    return cfg.architecture in QWEN3_VL_MEGATRON and cfg.vision is not None


def require_megatron_layout(cfg: ModelConfig, where: str, bridge: bool = False) -> None:
    """A vision-language model has a Megatron layout only as Megatron-Bridge saves it (torch_dist,
    ``bridge``): Megatron-LM's legacy and plain torch_dist layouts have no names for its vision tower. A Gated
    DeltaNet hybrid's conditional-generation checkpoint (``cfg.carried``) and Qwen3-VL (``is_qwen3_vl``) have one in
    both Megatron formats (Bridge's ``Qwen3VLModel`` names: ``models/common/hybrid/weights``,
    ``bridge_qwen3_vl_weight_map``). CheckpointError in one line otherwise."""
    if cfg.architecture in NO_MEGATRON_LAYOUT:
        raise CheckpointError(f"{where}: {no_megatron_layout(cfg.architecture)}")
    if cfg.vision is not None and not bridge and not is_qwen3_vl(cfg):
        raise CheckpointError(f"{where}: {cfg.architecture} has no Megatron layout yet in Megatron-LM's formats "
                              f"(--to megatron, megatron-dist: no names for its vision tower); its Megatron layout is "
                              f"Megatron-Bridge's (torch_dist, the text model under {BRIDGE_TEXT_PREFIX}): "
                              f"{BRIDGE_TARGET}")


def architecture_for(model_type: str | None, where: str) -> Architecture:
    """The architecture registered for an HF model_type; CheckpointError naming the supported ones otherwise.
    Only the model folder the type names is imported (the longest package name that is the type or a prefix
    of it, and only if its ``hf_model_types`` has the type): a conversion loads one architecture, not all."""
    named = [p for p in ARCHITECTURE_PACKAGES if isinstance(model_type, str) and model_type.startswith(p)
             and model_type[len(p):len(p) + 1] in ("", "_")]
    if named:
        arch = _architecture(max(named, key=len))
        if model_type in arch.hf_model_types:
            return arch
    archs = architectures()
    if model_type not in archs:
        raise CheckpointError(f"{where}: unknown architecture {model_type!r} (supported: {', '.join(sorted(archs))})")
    return archs[model_type]


def conversion_weight_map(arch: Architecture, cfg: ModelConfig, mtp_layers: int = 0) -> WeightMap:
    """The architecture's weight map for conversion (no TP vocab padding: converters pad per format); a Gated
    DeltaNet hybrid's with Megatron's one ``in_proj`` per linear layer and, with ``mtp_layers``, the MTP block
    (``HybridWeightMap.for_conversion``; ``mtp_layers`` from ``mtp_layers_of``)."""
    wmap = arch.weight_map(cfg, cfg.vocab_size)
    if is_hybrid(wmap):
        return wmap.for_conversion(mtp_layers)
    if mtp_layers:
        raise CheckpointError(f"{arch.name} has no MTP block (mtp.* tensors): only the Gated DeltaNet hybrids do")
    return wmap


def checkpoint_weight_map(arch: Architecture, cfg: ModelConfig, names: Iterable[str], where: str) -> WeightMap:
    """The conversion map of a checkpoint whose tensors are ``names`` (HF names, or Megatron keys): a hybrid's
    carries the MTP block when they hold one (``mtp_layers_of``)."""
    wmap = conversion_weight_map(arch, cfg)
    return wmap.for_conversion(mtp_layers_of(names, where)) if is_hybrid(wmap) else wmap


def megatron_weight_map(arch: Architecture, cfg: ModelConfig, mtp_layers: int = 0) -> WeightMap:
    """The conversion weight map with the Megatron names a torch_dist checkpoint of this model holds:
    the architecture's own for text models, Megatron-Bridge's for vision-language ones
    (``bridge_vl_weight_map``); CheckpointError for a model without a Megatron layout (``NO_MEGATRON_LAYOUT``)."""
    if cfg.architecture in NO_MEGATRON_LAYOUT:
        raise CheckpointError(no_megatron_layout(cfg.architecture))
    wmap = conversion_weight_map(arch, cfg, mtp_layers)
    if cfg.vision is None:
        return wmap
    return bridge_qwen3_vl_weight_map(wmap) if is_qwen3_vl(cfg) else bridge_vl_weight_map(wmap)


def is_hybrid(wmap: WeightMap) -> bool:
    """A Gated DeltaNet hybrid's map (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): a ``HybridWeightMap``. Its module
    (``models/common/hybrid/weights``) is not imported for the other models: while it is not loaded, no map
    is one."""
    hybrid = sys.modules.get("models.common.hybrid.weights")
    return hybrid is not None and isinstance(wmap, hybrid.HybridWeightMap)


def mtp_layers_of(names: Iterable[str], where: str) -> int:
    """How many MTP layers a checkpoint's HF tensor names (or Megatron keys) hold (``[language_model.]mtp.layers.
    {k}.*``; 0 without ``mtp.*``).
    pmz carries one MTP layer (Megatron-Bridge's mapping names ``mtp.layers.0`` only): CheckpointError for
    more, or for ``mtp.*`` tensors without a layer."""
    from models.common.hybrid.weights import MTP_PREFIX

    mtp = [n.removeprefix(BRIDGE_TEXT_PREFIX) for n in names]  # Qwen3VLModel's MTP block is language_model.mtp.*
    mtp = [n for n in mtp if n.startswith(MTP_PREFIX)]
    if not mtp:
        return 0
    layers = sorted({n.split(".")[2] for n in mtp if n.startswith(MTP_PREFIX + "layers.") and n.count(".") > 2})
    if layers != ["0"]:
        found = f"layers {', '.join(layers)}" if layers else f"no mtp.layers.* (only {sorted(mtp)[0]}, ...)"
        raise CheckpointError(f"{where}: an MTP block with {found}: pmz carries exactly one MTP layer (mtp.layers.0, "
                              f"the layout Megatron-Bridge maps)")
    return 1


def _bridge_names(wmap: WeightMap, tower: Callable[[WeightEntry], list[WeightEntry]]) -> WeightMap:
    """``wmap`` with every text entry's Megatron name under ``BRIDGE_TEXT_PREFIX`` and every tower entry (the
    first entries without a Megatron name) replaced by ``tower(entry)``."""

    def text(e: WeightEntry) -> WeightEntry:
        return replace(e, megatron=BRIDGE_TEXT_PREFIX + e.megatron)

    first: list[WeightEntry] = []
    for e in wmap.first_entries:
        if e.megatron is not None:
            first.append(text(e))
            continue
        assert e.shapes is not None, f"{e.param}: vision entries carry their shapes"
        first += tower(e)
    return replace(wmap, layer_entries=tuple(map(text, wmap.layer_entries)), first_entries=tuple(first),
                   last_entries=tuple(map(text, wmap.last_entries)),
                   moe_layer_entries=tuple(map(text, wmap.moe_layer_entries)))


def bridge_vl_weight_map(wmap: WeightMap) -> WeightMap:
    """Megatron-Bridge's names for a Qwen2-VL-family weight map (its ``Qwen25VLBridge`` mapping
    registry; docs/formats.md has the table): every text entry's Megatron name under
    ``BRIDGE_TEXT_PREFIX`` (same layouts: interleaved QKV, stacked gate/up, layer-stacked in torch_dist),
    and every vision tensor one plain entry named as in HF (Bridge's ``ReplicatedMapping("visual.**")``:
    the tower is transformers' module, so the packed ``mlp.gate_up_proj`` is stored as ``gate_proj`` and
    ``up_proj`` again)."""
    return _bridge_names(wmap, lambda e: [WeightEntry(name, (name,), (e.rules[j],), name, PLAIN, shapes=(e.shapes[j],))
                                          for j, name in enumerate(e.hf)])


def bridge_qwen3_vl_weight_map(wmap: WeightMap) -> WeightMap:
    """Megatron-Bridge's names for Qwen3-VL / Qwen3-VL-MoE (``qwen3_vl_bridge.py``'s mapping registry; docs/formats.md
    "Qwen3-VL and Qwen3-VL-MoE in Megatron checkpoints"): every text entry's Megatron name under
    ``BRIDGE_TEXT_PREFIX`` (Qwen3 / Qwen3-MoE layouts as they are), every tower tensor one entry named
    ``vision_model.*`` with megatron-core's TP split as its rule (``hybrid_weights.tower_entry``, the rule Qwen3.5's
    carried tower takes: blocks, merger, DeepStack mergers, ``qkv`` per head)."""
    from models.common.hybrid.weights import tower_entry

    def tower(e: WeightEntry) -> list[WeightEntry]:
        assert len(e.hf) == 1, f"{e.param}: tower entries are one HF tensor with its shape"
        return [tower_entry(e.hf[0], tuple(e.shapes[0]))]

    return _bridge_names(wmap, tower)


def model_from_config(hf_config: Any, where: str, megatron: bool | str,
                      mtp_layers: int = 0) -> tuple[Architecture, ModelConfig, WeightMap]:
    """Architecture, model config and conversion weight map of an HF config, for every reader and raw
    source; ``megatron``: the checkpoint is in a Megatron format (True: legacy, where vision-language
    models are refused; "torch_dist": vision-language models in Megatron-Bridge's names);
    ``mtp_layers``: the MTP layers the checkpoint holds (``mtp_layers_of``)."""
    arch = architecture_for(getattr(hf_config, "model_type", None), where)
    cfg = arch.model_config(hf_config)
    if megatron:
        require_megatron_layout(cfg, where, bridge=megatron == "torch_dist")
        return arch, cfg, megatron_weight_map(arch, cfg, mtp_layers)
    return arch, cfg, conversion_weight_map(arch, cfg, mtp_layers)


def unit_entries(wmap: WeightMap, unit: Unit) -> list[WeightEntry]:
    if unit == EMBED:
        return list(wmap.first_entries)
    if unit == FINAL:  # and a hybrid's MTP block, on the last stage
        return list(wmap.last_entries) + (wmap.mtp_entries() if is_hybrid(wmap) else [])
    return [e.format(int(unit)) for e in wmap.layer_templates(int(unit))]


def all_units(cfg: ModelConfig) -> list[Unit]:
    return [EMBED, *range(cfg.num_hidden_layers), FINAL]
