"""Which checkpoint format a path holds, and a reader for it."""

from __future__ import annotations

import os

from converters.checkpoint import CheckpointReader


def detect_format(path: str | os.PathLike) -> str:
    """'hf', 'megatron' (legacy torch) or 'megatron-dist' (torch_dist); CheckpointError otherwise.

    ``path`` may also be a verl ``global_step_N/actor`` folder (or the verl root holding the tracker),
    or a Megatron-Bridge checkpoint: see ``converters/megatron_sources.locate_source``."""
    from converters.megatron_sources import locate_source

    return locate_source(path).format


def open_reader(path: str | os.PathLike, *, arch: str | None = None, hf_config: str | None = None,
                vocab_size: int | None = None) -> CheckpointReader:
    """A reader for any supported checkpoint; Megatron sources take ``arch``/``hf_config``/``vocab_size``.

    Where the checkpoint has no Megatron args, the HF config found beside it (verl's huggingface/,
    Megatron-Bridge's hf/) describes the model unless ``hf_config`` is given."""
    from converters.megatron_sources import locate_source

    location = locate_source(path)
    path, hf_config = location.path, hf_config or location.hf_config_dir
    if location.format == "hf":
        from converters.hf import HFReader

        return HFReader(path)
    if location.format == "megatron":
        from converters.megatron_legacy import LegacyReader

        return LegacyReader(path, arch=arch, hf_config_dir=hf_config, vocab_size=vocab_size)
    from converters.megatron_dist import DistReader

    return DistReader(path, arch=arch, hf_config_dir=hf_config, vocab_size=vocab_size)
