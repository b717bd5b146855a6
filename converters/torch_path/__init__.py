"""The torch path: conversions that need tensors (dtype changes, mixture-of-experts models, vLLM
targets, sources the copy path leaves), run by worker processes that each rebuild their reader.

One reader per source format, each a thin layer over its format's validating reader in
``converters/formats`` (so the checks the copy path relies on are the checks made here): ``READERS``
maps the format names ``converters.formats.detect_format`` gives to them. Writers: ``hf`` (HF
safetensors shards), ``megatron`` (legacy rank files and torch_dist through ``megatron_legacy`` /
``megatron_dist``), ``vllm`` (vLLM ``sharded_state``). Importing this package does not import torch.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

READERS = {
    "hf": "converters.torch_path.hf:HFReader",
    "megatron": "converters.torch_path.megatron_legacy:LegacyReader",
    "megatron-dist": "converters.torch_path.megatron_dist:DistReader",
    "vllm": "converters.torch_path.vllm:VllmReader",
}


def open_reader(path: str | os.PathLike, *, arch: str | None = None, hf_config: str | None = None,
                vocab_size: int | None = None) -> Any:
    """A reader (``converters.torch_path.reader.CheckpointReader``) for any supported checkpoint;
    Megatron sources take ``arch``/``hf_config``/``vocab_size``.

    Where the checkpoint has no Megatron args, the HF config found beside it (verl's huggingface/,
    Megatron-Bridge's hf/) describes the model unless ``hf_config`` is given. A quantized source (a
    ``quantization_config`` in that config, FP8 tensors) is refused (``converters/formats/quantized``)."""
    from converters.formats.locate import locate_source
    from converters.formats.quantized import check_unquantized_config

    location = locate_source(path, hf_config)
    check_unquantized_config(location, hf_config)
    path, hf_config = location.path, hf_config or location.hf_config_dir
    module, name = READERS[location.format].split(":")
    cls = getattr(importlib.import_module(module), name)
    if location.format in ("hf", "vllm"):  # they describe themselves (config.json beside the weights)
        return cls(path)
    return cls(path, arch=arch, hf_config_dir=hf_config, vocab_size=vocab_size)
