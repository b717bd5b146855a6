"""What every checkpoint reader offers the conversion engine: HF-named full tensors, one unit at a time.

A *unit* is the embedding (``EMBED``), one decoder layer (its global index) or the final norm and
output layer (``FINAL``). Readers turn their format into the HF tensors of a unit; writers consume
units. Peak memory is therefore a few units, whatever the model size.

Readers are rebuilt inside worker processes from ``reader.reopen_args()`` (path + options), so
nothing large crosses process boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from models.common.architecture import Architecture
from models.common.config import ModelConfig
from models.common.weight_map import WeightEntry, WeightMap

if TYPE_CHECKING:  # readers hand out torch tensors; the module itself (architectures, units) is torch-free
    import torch

EMBED = "embed"
FINAL = "final"
Unit = Union[int, str]


def architectures() -> dict[str, Architecture]:
    """Registered architectures by HF model_type."""
    from models.llama.architecture import ARCHITECTURE as LLAMA
    from models.qwen2.architecture import ARCHITECTURE as QWEN2
    from models.qwen2_moe.architecture import ARCHITECTURE as QWEN2_MOE
    from models.qwen2_vl.architecture import ARCHITECTURE as QWEN2_VL

    return {t: arch for arch in (LLAMA, QWEN2, QWEN2_MOE, QWEN2_VL) for t in arch.hf_model_types}


def require_megatron_layout(cfg: ModelConfig, where: str) -> None:
    """Megatron formats name every tensor by its Megatron module; the vision tower of a
    vision-language model has no such names here yet (HF and vLLM formats only)."""
    if cfg.vision is not None:
        from models.common.errors import CheckpointError

        raise CheckpointError(f"{where}: {cfg.architecture} has no Megatron layout yet (its vision tower has no "
                              f"Megatron names here); convert it between HF and vLLM formats")


def architecture_for(model_type: str | None, where: str) -> Architecture:
    from models.common.errors import CheckpointError

    archs = architectures()
    if model_type not in archs:
        raise CheckpointError(f"{where}: unknown architecture {model_type!r} (supported: {', '.join(sorted(archs))})")
    return archs[model_type]


def conversion_weight_map(arch: Architecture, cfg: ModelConfig) -> WeightMap:
    """The architecture's weight map for conversion (no TP vocab padding: converters pad per format)."""
    return arch.weight_map(cfg, cfg.vocab_size)


def model_from_config(hf_config: Any, where: str, megatron: bool) -> tuple[Architecture, ModelConfig, WeightMap]:
    """Architecture, model config and conversion weight map of an HF config, for every reader and raw
    source; ``megatron``: the checkpoint is in a Megatron format (refused for models without Megatron names)."""
    arch = architecture_for(getattr(hf_config, "model_type", None), where)
    cfg = arch.model_config(hf_config)
    if megatron:
        require_megatron_layout(cfg, where)
    return arch, cfg, conversion_weight_map(arch, cfg)


def unit_entries(wmap: WeightMap, unit: Unit) -> list[WeightEntry]:
    if unit == EMBED:
        return list(wmap.first_entries)
    if unit == FINAL:
        return list(wmap.last_entries)
    return [e.format(int(unit)) for e in wmap.layer_templates(int(unit))]


def all_units(cfg: ModelConfig) -> list[Unit]:
    return [EMBED, *range(cfg.num_hidden_layers), FINAL]


@dataclass
class ReaderInfo:
    """Description shown by ``pmz inspect`` and used to plan writes."""

    format: str
    architecture: str
    layout: dict[str, Any] = field(default_factory=dict)
    files: int = 0
    dtype: Any = None  # torch.dtype of the stored floating-point tensors (set by every reader)


class CheckpointReader:
    """Base class. Subclasses set ``arch``, ``hf_config``, ``cfg``, ``wmap``, ``info``."""

    arch: Architecture
    hf_config: Any
    cfg: ModelConfig
    wmap: WeightMap
    info: ReaderInfo
    path: str
    megatron = False  # a Megatron format (needs every tensor's Megatron name)

    def _set_model(self, hf_config: Any, where: str) -> None:
        """Architecture, model config and weight map from an HF config (shared by every reader)."""
        self.hf_config = hf_config
        self.arch, self.cfg, self.wmap = model_from_config(hf_config, where, self.megatron)

    def _remember_args(self, *args: Any, **kwargs: Any) -> None:
        """Record the constructor arguments, so ``reopen_args`` can rebuild this reader elsewhere."""
        self._ctor = (type(self), args, kwargs)

    def reopen_args(self) -> tuple:
        """``(callable, args)`` that rebuilds this reader in another process."""
        return _construct, self._ctor

    def units(self) -> list[Unit]:
        return all_units(self.cfg)

    def read_unit(self, unit: Unit) -> dict[str, torch.Tensor]:
        """HF name -> full tensor for every HF tensor of ``unit``."""
        raise NotImplementedError

    def read_unit_pieces(self, unit: Unit) -> dict[str, list[torch.Tensor]]:
        """Like ``read_unit``, but each tensor may come as row pieces (views into the source) whose
        concatenation along dim 0 is the tensor: writers stream them without building it."""
        return {name: [t] for name, t in self.read_unit(unit).items()}

    def validate(self) -> None:
        """Check every file and tensor the conversion will need, before anything is written."""
        raise NotImplementedError

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full HF tensor shapes implied by the config (computed once)."""
        cached = self.__dict__.get("_hf_shapes")
        if cached is None:
            from models.common.weight_map import hf_shapes

            cached = self.__dict__["_hf_shapes"] = hf_shapes(self.cfg, self.wmap)
        return cached

    def close(self) -> None:
        pass


def _construct(cls: type, args: tuple, kwargs: dict) -> CheckpointReader:
    return cls(*args, **kwargs)


def reopen(reopen_args: tuple) -> CheckpointReader:
    """Rebuild a reader from ``reader.reopen_args()`` (inside a worker process)."""
    factory, args = reopen_args
    return factory(*args)
