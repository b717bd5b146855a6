"""``pmz inspect``: what a checkpoint directory holds, read from headers only (no tensor data)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from models.common.builder import load_hf_config
from models.common.sources import DTYPE_BYTES, CheckpointError, SafetensorsSource


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
            size += n * DTYPE_BYTES[tag]
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
