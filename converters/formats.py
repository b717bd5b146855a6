"""Which checkpoint format a path holds, and a reader for it."""

from __future__ import annotations

import os
from pathlib import Path

from converters.checkpoint import CheckpointReader
from models.common.errors import CheckpointError


def detect_format(path: str | os.PathLike) -> str:
    """'hf', 'megatron' (legacy torch) or 'megatron-dist' (torch_dist); CheckpointError otherwise."""
    from converters.megatron_files import resolve_iteration_dir

    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a checkpoint directory")
    if (p / "config.json").exists() and (any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").exists()):
        return "hf"
    it_dir = resolve_iteration_dir(p)
    if (it_dir / "metadata.json").exists():
        return "megatron-dist"
    if any(it_dir.glob("mp_rank_*")):
        return "megatron"
    raise CheckpointError(f"{p}: not a recognized checkpoint (HF: config.json + *.safetensors; Megatron: "
                          f"latest_checkpointed_iteration.txt / iter_*/ with mp_rank_* or metadata.json)")


def open_reader(path: str | os.PathLike, *, arch: str | None = None, hf_config: str | None = None,
                vocab_size: int | None = None) -> CheckpointReader:
    """A reader for any supported checkpoint; Megatron sources take ``arch``/``hf_config``/``vocab_size``."""
    fmt = detect_format(path)
    if fmt == "hf":
        from converters.hf import HFReader

        return HFReader(path)
    if fmt == "megatron":
        from converters.megatron_legacy import LegacyReader

        return LegacyReader(path, arch=arch, hf_config_dir=hf_config, vocab_size=vocab_size)
    from converters.megatron_dist import DistReader

    return DistReader(path, arch=arch, hf_config_dir=hf_config, vocab_size=vocab_size)
