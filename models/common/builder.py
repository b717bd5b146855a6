"""``build_parallel_model`` shared by every dense architecture.

Order matters for failure behaviour: the config and the parallel layout are validated, and the
checkpoint's headers are checked (every tensor present with the right shape), on every rank
*before* any process group is created or collective entered, so bad input fails identically and
immediately everywhere instead of hanging the job.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from models.common.architecture import Architecture  # noqa: F401 (re-exported)
from models.common.causal_lm import ParallelCausalLM
from models.common.compiled_layers import check_compile_backend, check_compile_option, compile_layers
from models.common.config import ModelConfig
from models.common.sources import (
    CheckpointError,
    RandomSource,
    RenamedSource,
    TensorSource,
    read_config_json,
)
from models.common.weights import checkpoint_source, hf_shapes, load_weights, validate_source
from parallel.config import ParallelConfig, ParallelConfigError
from parallel.groups import ParallelGroups, build_groups
from parallel.layers import set_tp_reduce_in_fp32
from parallel.lm_head_loss import check_chunk_tokens


def load_hf_config(directory: str | os.PathLike) -> Any:
    """transformers config from a local directory (never downloads); CheckpointError if unreadable."""
    read_config_json(directory)  # clear errors before transformers sees the file
    path = Path(directory)
    cfg_file = path / "config.json"
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise CheckpointError(f"{cfg_file}: transformers cannot read this config ({exc})") from exc


def random_source(arch: Architecture, cfg: ModelConfig, pconfig: ParallelConfig, seed: int) -> RandomSource:
    """Deterministic random HF-named weights: normal(0, initializer_range) matrices, unit norms, zero biases."""
    wmap = arch.weight_map(cfg, pconfig.padded_vocab_size(cfg.vocab_size))
    specs = {}
    for name, shape in hf_shapes(cfg, wmap).items():
        norm = name.endswith(("norm.weight", ".norm1.weight", ".norm2.weight", ".ln_q.weight"))  # + vision towers'
        init = "ones" if norm else "zeros" if name.endswith(".bias") else "normal"
        specs[name] = (shape, init)
    return RandomSource(specs, seed=seed, std=cfg.initializer_range)


def build_model(arch: Architecture, source: Any, parallel_config: ParallelConfig | None = None, *,
                dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                groups: ParallelGroups | None = None, seed: int = 0, lora: Any = None,
                loss_chunk_tokens: int | None = None, compile: bool = False) -> ParallelCausalLM:
    """Build this rank's part of the model and fill it from ``source``.

    source: an HF model directory (config.json + safetensors), a transformers config (deterministic
        random weights from ``seed``, identical on every rank and at every TP size), or a
        ``TensorSource`` together with a transformers config as ``(hf_config, tensor_source)``.
    parallel_config: the layout (default: everything 1). Call after ``init_process_group`` when
        any size is > 1. ``groups`` reuses already-built groups (e.g. ``groups_from_megatron()``).
    lora: a ``peft.LoraConfig``: LoRA factors on the targeted modules, base weights frozen
        (``models/common/blocks/lora.py``); fill them from an adapter with ``model.load_lora_adapter``.
    loss_chunk_tokens: tokens per chunk of the fused LM-head loss (``parallel/lm_head_loss.py``; None:
        from a byte budget for one chunk's logits); also settable later as ``model.loss_chunk_tokens``.
    compile: each decoder layer's forward through ``torch.compile`` (``models/common/compiled_layers.py``);
        CompileUnavailableError in one line, before any group exists, where the backend cannot build kernels.
    """
    check_chunk_tokens(loss_chunk_tokens)
    check_compile_option(compile)
    if compile:
        check_compile_backend(device)
    parallel_config = parallel_config or (groups.config if groups is not None else ParallelConfig())
    tensor_source: TensorSource | None = None
    where = "checkpoint"
    if isinstance(source, (str, os.PathLike)):
        hf_config = load_hf_config(source)
        where = str(source)
    elif isinstance(source, tuple):
        hf_config, tensor_source = source
    else:
        hf_config = source
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in arch.hf_model_types:
        raise CheckpointError(f"{where}: model_type={model_type!r} is not a {arch.name} model "
                              f"(expected one of {', '.join(arch.hf_model_types)})")
    cfg = arch.model_config(hf_config)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    parallel_config.validate(cfg, world_size=world)
    wmap = arch.weight_map(cfg, parallel_config.padded_vocab_size(cfg.vocab_size))
    if cfg.moe is None and parallel_config.ep > 1:
        raise ParallelConfigError(f"{parallel_config.describe()}: ep > 1 needs a mixture-of-experts model, "
                                  f"{arch.name} has none")
    if cfg.moe is not None:
        _check_moe_layout(arch, parallel_config, lora)
    lora_targets = None
    if lora is not None:
        from models.common.blocks.lora import check_lora_config

        lora_targets = check_lora_config(cfg, wmap, lora, parallel_config, hf_shapes(cfg, wmap), arch.module_name)
    unloaded: tuple[str, ...] = ()
    if isinstance(source, (str, os.PathLike)):  # fused experts read per expert, as the converters read them
        tensor_source = checkpoint_source(source, cfg, arch.canonical_name if arch.hf_key_aliases else None, where,
                                          transposed_experts=wmap.fused_experts)
    elif tensor_source is not None and arch.hf_key_aliases:
        tensor_source = RenamedSource(tensor_source, arch.canonical_name, where)
    if tensor_source is not None:
        allowed = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
        unloaded = _unloaded_tensors(wmap, tensor_source.names())
        allowed += unloaded
        validate_source(tensor_source, hf_shapes(cfg, wmap), where, allowed_extra=allowed)
    else:
        tensor_source = random_source(arch, cfg, parallel_config, seed)

    if groups is None:
        groups = build_groups(parallel_config, device)
    elif groups.config != parallel_config:  # modules read fsdp/recompute/cp_comm/SP from groups.config
        raise ParallelConfigError(f"groups were built for {groups.config.describe()}, not {parallel_config.describe()}")
    if parallel_config.fsdp and groups.replica_mesh is None:
        raise ParallelConfigError(f"{parallel_config.describe()}: fsdp needs groups with a replica DeviceMesh "
                                  f"(build them with parallel.build_groups, not groups_from_megatron)")
    model = _model_class(arch)(cfg, groups, wmap, dtype=dtype, device=device)
    model.hf_config = hf_config  # what save_pretrained writes as config.json
    model.loss_chunk_tokens = loss_chunk_tokens
    model.source_dir = str(source) if isinstance(source, (str, os.PathLike)) else None  # tokenizer files for exports
    model.unloaded_tensors = unloaded  # source tensors left unread (MTP, a vision tower): save_pretrained carries them
    load_weights(dict(model.named_parameters()), model.load_entries(), tensor_source, groups.tp_rank, groups.tp_size,
                 groups.ep_rank, groups.ep_size)
    if lora is not None:
        from models.common.blocks.lora import apply_lora

        apply_lora(model, lora, lora_targets, seed=seed)
    set_tp_reduce_in_fp32(model, parallel_config.tp_reduce_in_fp32)  # every row-parallel layer, tower's too
    if compile:  # before FSDP2 wraps the layers: its hooks stay outside the compiled forward
        compile_layers(model.model.layers.values())
    if parallel_config.fsdp:
        from parallel.fsdp import shard_model

        shard_model(model, groups, forward_methods=("packed_logits", "packed_losses"))
    return model


def _unloaded_tensors(wmap: Any, names: set[str]) -> tuple[str, ...]:
    """Checkpoint tensors the model does not hold and leaves unread, as transformers' CausalLM classes do:
    a Gated DeltaNet hybrid's MTP block (``mtp.*``; pmz converts it, models/common/hybrid/weights.py) and a
    conditional-generation checkpoint's vision tower (``model.visual.*``, models/common/hybrid/vision.py)."""
    from models.common.hybrid.vision import VISUAL_PREFIX
    from models.common.hybrid.weights import MTP_PREFIX, HybridWeightMap
    from models.common.weight_map import IGNORED_SUFFIXES

    if not isinstance(wmap, HybridWeightMap):
        return ()
    return tuple(sorted(n for n in names if n.startswith((MTP_PREFIX, VISUAL_PREFIX))
                        and not n.endswith(IGNORED_SUFFIXES)))  # non-weights (rotary buffers): never carried


def _model_class(arch: Architecture) -> type:
    if arch.model_class is None:
        return ParallelCausalLM
    import importlib

    module, name = arch.model_class.split(":")
    return getattr(importlib.import_module(module), name)


def _check_moe_layout(arch: Architecture, pconfig: ParallelConfig, lora: Any) -> None:
    """What mixture-of-experts models do not support, refused before any group exists.

    FSDP2 with ep > 1: FSDP2 shards every parameter of a layer over the replica mesh (the dp, cp and
    ulysses ranks of a tp/pp slot) and all-gathers it back assuming each rank held the same tensor,
    but the EP ranks of that mesh hold different experts (sharding experts over their own
    expert-data-parallel mesh is not built). ep > 1 with ulysses > 1 is refused by ``ParallelConfig``;
    LoRA on the experts and the router by ``blocks/lora.py`` (``lora`` is checked there)."""
    if pconfig.fsdp and pconfig.ep > 1:
        raise ParallelConfigError(f"{arch.name} {pconfig.describe()}: fsdp with ep={pconfig.ep} is not supported "
                                  f"(FSDP2 shards each parameter over the dp*cp*ulysses replica ranks, which hold "
                                  f"different experts under expert parallelism); use fsdp with ep=1 or ep without fsdp")
