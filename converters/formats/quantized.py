"""Quantized checkpoints as sources: refused in one line, never dequantized or passed through.

pmz reads training weights (fp32 / bf16 / fp16) and writes FP8 only as an output
(``pmz convert --quantize fp8``, rule in ``models/common/export/fp8.py``). A source that is already
quantized would otherwise come out wrong: its ``<name>_scale_inv`` tensors are not in the weight
map, and an ``F8_*`` tensor read as a float without its scales has the wrong magnitude; a config
carrying ``quantization_config`` beside unquantized weights makes loaders expect FP8 tensors. So the
config a conversion reads the model from (the source's own config.json, or the HF config beside or
given for a Megatron checkpoint) and the tensors' dtypes are checked before anything is written.

Plain Python (no torch): the copy path's checks run through here too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

from models.common.errors import CheckpointError

QUANTIZED_TAGS = ("F8_E4M3", "F8_E5M2", "F8_E8M0")  # safetensors' float8 dtype tags
REASON = "pmz reads unquantized weights only (it neither dequantizes nor passes FP8 through; convert the unquantized " \
         "model, --quantize fp8 writes FP8 from it)"


def config_dir(location, hf_config: str | None = None) -> str | None:
    """The directory whose config.json describes the source: its own for HF and vLLM directories,
    else ``--hf-config`` or the HF config found beside the Megatron checkpoint (None: Megatron args)."""
    if location.format in ("hf", "vllm"):
        return location.path
    return hf_config or location.hf_config_dir


def quantization_config_of(location, hf_config: str | None = None) -> tuple[Path | None, object]:
    """``(config.json path, its quantization_config)`` of the config the model is read from; the
    second item None when there is none (a missing or malformed config.json is the format reader's
    error to report)."""
    directory = config_dir(location, hf_config)
    path = Path(directory) / "config.json" if directory else None
    if path is None or not path.is_file():
        return path, None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return path, None
    if not isinstance(data, dict):
        return path, None
    qconfig = data.get("quantization_config")
    if qconfig is None and isinstance(data.get("text_config"), dict):
        qconfig = data["text_config"].get("quantization_config")
    return path, qconfig


def describe(qconfig) -> str:
    """``quant_method 'fp8', fmt 'e4m3', weight_block_size [128, 128]`` (what a message names)."""
    if not isinstance(qconfig, dict):
        return repr(qconfig)
    return ", ".join(f"{k} {qconfig[k]!r}" for k in ("quant_method", "fmt", "weight_block_size") if k in qconfig)


def check_unquantized_config(location, hf_config: str | None = None) -> None:
    """CheckpointError naming the file when the config the model is read from has a ``quantization_config``."""
    path, qconfig = quantization_config_of(location, hf_config)
    if qconfig is not None:
        raise CheckpointError(f"{path}: a quantized checkpoint's config (quantization_config: {describe(qconfig)}): "
                              f"{REASON}")


def check_unquantized_tensors(where: str, tags: Iterable[tuple[str, str]],
                              file_of: Callable[[str], object] | None = None) -> None:
    """CheckpointError naming the first ``(name, dtype tag)`` stored as float8 (and how many are), and
    the file holding it (``file_of(name)``; else ``where``). The format readers call it before they
    compare names with the weight map, so a quantized checkpoint is called one, not a list of
    unexpected ``*_scale_inv`` tensors."""
    quantized = [(name, tag) for name, tag in tags if tag in QUANTIZED_TAGS]
    if quantized:
        name, tag = sorted(quantized)[0]
        more = f" and {len(quantized) - 1} more" if len(quantized) > 1 else ""
        place = file_of(name) if file_of is not None else where
        raise CheckpointError(f"{place}: {name} is stored as {tag}{more}: an FP8-quantized checkpoint; {REASON}")
