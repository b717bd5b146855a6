"""``pmz inspect``: what a checkpoint directory holds, read from headers only (no tensor data)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from models.common.builder import load_hf_config
from models.common.sources import CheckpointError, SafetensorsSource

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def inspect_checkpoint(path: str | os.PathLike) -> dict:
    """Format, architecture, parameter count, dtypes and bytes of a checkpoint directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if (path / "config.json").exists() and any(path.glob("*.safetensors*")):
        hf_config = load_hf_config(path)
        source = SafetensorsSource(path)
        dtypes: Counter = Counter()
        params = size = 0
        for name in source.names():
            n = 1
            for d in source.shape(name):
                n *= d
            params += n
            tag = source.dtype_name(name)
            dtypes[tag] += n
            size += n * _DTYPE_BYTES.get(tag, 0)
        return {
            "format": "hf-safetensors",
            "architecture": (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0],
            "model_type": hf_config.model_type,
            "layers": getattr(hf_config, "num_hidden_layers", None),
            "parallel_layout": "unsharded (HF)",
            "files": len(source.files),
            "tensors": len(source.names()),
            "parameters": params,
            "dtypes": dict(dtypes),
            "bytes": size,
        }
    raise CheckpointError(f"{path}: not a recognized checkpoint (expected config.json + *.safetensors)")
