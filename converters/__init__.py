"""Checkpoint formats and conversion (HF, Megatron legacy/torch_dist); CPU only, no torch.distributed.

    from converters import convert, open_reader, verify
    convert("ckpt/megatron", "out/hf", to="hf")
"""

from converters.engine import convert
from converters.formats import detect_format, open_reader

__all__ = ["convert", "detect_format", "open_reader"]
