"""Checkpoint formats and conversion (HF, Megatron legacy/torch_dist, vLLM); CPU only, no torch.distributed.

    from converters import convert, open_reader, verify
    convert("ckpt/megatron", "out/hf", to="hf")

The names load on first use, so the CLI and the copy path start without importing torch.
"""

__all__ = ["convert", "detect_format", "open_reader"]


def __getattr__(name: str):
    if name == "convert":
        from converters.engine import convert

        return convert
    if name == "detect_format":
        from converters.formats import detect_format

        return detect_format
    if name == "open_reader":
        from converters.torch_path import open_reader

        return open_reader
    raise AttributeError(f"module 'converters' has no attribute {name!r}")
