"""The one function users call per model folder, ``from models.X import build_parallel_model``, made from
a declaration: ``build_parallel_model = entry_point(ARCHITECTURE, "Qwen2", __name__)``.

Every folder's function was the same fourteen lines around ``builder.build_model``; they are made here once,
with the signature written out (``help(build_parallel_model)`` and editors show the keyword arguments, not
``**kwargs``), the folder's module and name (tracebacks and ``help`` say ``models.qwen2.model``), and the
folder's one difference stated in the declaration: a LoRA refusal (Qwen2-VL, Qwen2.5-VL), or a
vision-language architecture beside the text one (the Gated DeltaNet hybrids: a conditional-generation
config or checkpoint builds ``vl_arch`` unless ``text_only=True``).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from models.common.architecture import Architecture
from models.common.builder import build_model, load_hf_config
from models.common.causal_lm import ParallelCausalLM
from models.common.hybrid.vl import is_conditional_generation
from parallel.config import ParallelConfig
from parallel.groups import ParallelGroups

_CALL = ("Call after ``torch.distributed.init_process_group`` when the layout uses more than one rank. See "
         "``models.common.builder.build_model`` for the arguments.")


def _named(fn: Callable, module: str, doc: str, returns: str) -> Callable:
    fn.__module__ = module
    fn.__qualname__ = fn.__name__ = "build_parallel_model"
    fn.__doc__ = doc
    fn.__annotations__["return"] = returns
    return fn


def entry_point(arch: Architecture, label: str, module: str, *, returns: str = "ParallelCausalLM",
                lora_refusal: str | None = None) -> Callable[..., ParallelCausalLM]:
    """``build_parallel_model`` of a model folder (``module``: its ``__name__``) building ``arch``; with
    ``lora_refusal``, a ``lora`` argument is refused with that message (ValueError) before anything is built."""

    def build_parallel_model(source: Any, parallel_config: ParallelConfig | None = None, *,
                             dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                             groups: ParallelGroups | None = None, seed: int = 0, lora: Any = None,
                             loss_chunk_tokens: int | None = None, compile: bool = False) -> ParallelCausalLM:
        if lora is not None and lora_refusal is not None:
            raise ValueError(lora_refusal)
        return build_model(arch, source, parallel_config, dtype=dtype, device=device, groups=groups, seed=seed,
                           lora=lora, loss_chunk_tokens=loss_chunk_tokens, compile=compile)

    return _named(build_parallel_model, module, f"Build this rank's {label} shard from an HF directory or a "
                  f"transformers config (random weights).\n\n{_CALL}", returns)


def build_hybrid(arch: Architecture, vl_arch: Architecture, source: Any, parallel_config: ParallelConfig | None, *,
                 text_only: bool, **kwargs) -> ParallelCausalLM:
    """``build_model`` with ``vl_arch`` (the vision-language model) for a conditional-generation config or
    checkpoint unless ``text_only``, else ``arch`` (the text model; a conditional-generation checkpoint's
    tower is then carried bitwise, as before the vision-language build existed)."""
    if not text_only:
        hf_config = source[0] if isinstance(source, tuple) else source
        if isinstance(source, (str, os.PathLike)):
            hf_config = load_hf_config(source)
        if is_conditional_generation(hf_config):
            arch = vl_arch  # LoRA: text and tower (models/common/blocks/lora.py)
    return build_model(arch, source, parallel_config, **kwargs)


def hybrid_entry_point(arch: Architecture, vl_arch: Architecture, label: str, module: str, *,
                       vl_model: str) -> Callable[..., ParallelCausalLM]:
    """``build_parallel_model`` of a Gated DeltaNet hybrid's folder: the text model ``arch``, or from a
    conditional-generation config or checkpoint the vision-language model ``vl_arch`` (``vl_model``: its class,
    for the docstring) unless ``text_only=True``."""

    def build_parallel_model(source: Any, parallel_config: ParallelConfig | None = None, *,
                             dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                             groups: ParallelGroups | None = None, seed: int = 0, lora: Any = None,
                             loss_chunk_tokens: int | None = None, compile: bool = False,
                             text_only: bool = False) -> ParallelCausalLM:
        return build_hybrid(arch, vl_arch, source, parallel_config, text_only=text_only, dtype=dtype, device=device,
                            groups=groups, seed=seed, lora=lora, loss_chunk_tokens=loss_chunk_tokens, compile=compile)

    doc = (f"Build this rank's {label} shard from an HF directory or a transformers config (random weights).\n\n"
           f"A conditional-generation config or checkpoint gives {vl_model} (the vision tower runs); "
           "``text_only=True`` builds its text model alone (the tower carried, not run). Text configs and "
           f"causal-LM checkpoints give the hybrid causal LM. {_CALL}")
    return _named(build_parallel_model, module, doc, "ParallelCausalLM")


__all__ = ["build_hybrid", "entry_point", "hybrid_entry_point"]
