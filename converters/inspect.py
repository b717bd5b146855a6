"""``pmz inspect``: what a checkpoint holds, from headers and metadata (tensor data is not read)."""

from __future__ import annotations

import os
from pathlib import Path

from converters.formats import open_reader


def inspect_checkpoint(path: str | os.PathLike, *, vocab_size: int | None = None, hf_config: str | None = None) -> dict:
    """Format, architecture, parallel layout, parameter count, dtype and bytes on disk."""
    reader = open_reader(path, vocab_size=vocab_size, hf_config=hf_config)
    shapes = reader.hf_shapes()
    params = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        params += n
    cfg = reader.cfg
    size = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
    return {
        "format": reader.info.format,
        "architecture": reader.arch.name,
        "model": f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, ffn {cfg.intermediate_size}, "
                 f"heads {cfg.num_attention_heads} (kv {cfg.num_key_value_heads}, head_dim {cfg.head_dim}), "
                 f"vocab {cfg.vocab_size}, {'tied' if cfg.tie_word_embeddings else 'untied'} embeddings",
        "parallel_layout": ", ".join(f"{k}={v}" for k, v in reader.info.layout.items() if v is not None),
        "files": reader.info.files,
        "parameters": params,
        "dtype": str(reader.info.dtype).replace("torch.", ""),
        "bytes": size,
    }
