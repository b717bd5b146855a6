"""Checkpoint formats, torch-free: one module per format, each with the format's one validating
reader (files, headers, metadata and every tensor checked once, tensors listed as byte ranges) and,
beside it, what writing the format needs (file layouts, names, metadata structures).

  hf              HF directory: config.json + safetensors (``models/common/hf_files`` reads the files)
  megatron_legacy Megatron-LM ``torch`` rank files (``torch_zip`` archives, restricted ``pickles``)
  megatron_dist   megatron-core ``torch_dist``: metadata.json, .metadata, .distcp chunks, common.pt
  megatron_bridge Megatron-Bridge's run_config.yaml (bounded, data only)
  megatron_args   Megatron args <-> HF config, trackers and iteration folders (``megatron_moe``: MoE args)
  vllm_sharded    vLLM ``sharded_state`` directories as a source (the writer's rules inverted)
  locate          what a path holds (Megatron-LM, verl, Megatron-Bridge layouts) and ``detect_format``

Both execution paths consume the same readers: the copy path (``converters/copy_path``) plans byte
ranges from them, the torch path (``converters/torch_path``) maps them as tensors. A new source
format (as vLLM ``sharded_state`` was) is one module here with a validating reader, one entry in
``CHECKPOINTS`` below, a reader class in ``torch_path.READERS`` and, if the copy path should read
it, a raw source in ``copy_path.sources.RAW_SOURCES``; ``locate`` recognises its directories.
"""

from __future__ import annotations

import os
from typing import Any

# format name (as detect_format says it) -> "module:class" of its validating reader
CHECKPOINTS = {
    "hf": "converters.formats.hf:HFCheckpoint",
    "megatron": "converters.formats.megatron_legacy:LegacyCheckpoint",
    "megatron-dist": "converters.formats.megatron_dist:DistCheckpoint",
    "vllm": "converters.formats.vllm_sharded:VllmShardedCheckpoint",
}


def detect_format(path: str | os.PathLike) -> str:
    """'hf', 'megatron' (legacy torch) or 'megatron-dist' (torch_dist); CheckpointError otherwise.

    ``path`` may also be a verl ``global_step_N/actor`` folder (or the verl root holding the tracker),
    or a Megatron-Bridge checkpoint: see ``converters/formats/locate.locate_source``."""
    from converters.formats.locate import locate_source

    return locate_source(path).format


def open_checkpoint(fmt: str, path: str, **options: Any) -> Any:
    """The validating reader of format ``fmt`` for ``path`` (the folder ``locate_source`` found);
    Megatron formats take ``arch``, ``hf_config_dir`` and ``vocab_size``."""
    import importlib

    module, name = CHECKPOINTS[fmt].split(":")
    return getattr(importlib.import_module(module), name)(path, **options)
