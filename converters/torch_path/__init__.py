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
                vocab_size: int | None = None, fp8: bool = False) -> Any:
    """A reader (``converters.torch_path.reader.CheckpointReader``) for any supported checkpoint;
    Megatron sources take ``arch``/``hf_config``/``vocab_size``.

    Where the checkpoint has no Megatron args, the HF config found beside it (verl's huggingface/,
    Megatron-Bridge's hf/) describes the model unless ``hf_config`` is given. A quantized source (a
    ``quantization_config`` in that config, FP8 tensors) is refused (``converters/formats/quantized``),
    except, with ``fp8`` (``pmz inspect`` / ``pmz verify``), an HF directory in the block-wise FP8
    format, read dequantized (``hf_fp8_reader.FP8HFReader``)."""
    from converters.formats.locate import locate_source
    from converters.formats.quantized import check_unquantized_config, describe, quantization_config_of
    from models.common.errors import CheckpointError

    location = locate_source(path, hf_config)
    config_path, qconfig = quantization_config_of(location, hf_config)
    if fp8 and qconfig is not None and location.format == "hf":
        from converters.torch_path.hf_fp8_reader import FP8HFReader

        return FP8HFReader(location.path)
    if fp8 and qconfig is not None and location.format == "vllm":
        raise CheckpointError(f"{config_path}: a quantized {location.layout} checkpoint (quantization_config: "
                              f"{describe(qconfig)}): pmz reads FP8 back only from an HF directory (pmz convert "
                              f"SRC DST --to hf --quantize fp8 writes one)")
    check_unquantized_config(location, hf_config)
    path, hf_config = location.path, hf_config or location.hf_config_dir
    module, name = READERS[location.format].split(":")
    cls = getattr(importlib.import_module(module), name)
    if location.format in ("hf", "vllm"):  # they describe themselves (config.json beside the weights)
        return cls(path)
    return cls(path, arch=arch, hf_config_dir=hf_config, vocab_size=vocab_size)
