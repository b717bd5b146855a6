"""The non-tensor files of an HF model directory (config.json, tokenizer and generation files),
read and copied without torch."""

from __future__ import annotations

import json
import os
from pathlib import Path

from models.common.errors import CheckpointError

COMPANION_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".py", ".jinja")
NOT_COMPANIONS = {"config.json", "model.safetensors.index.json"}


def copy_companion_files(source: str | os.PathLike, directory: str | os.PathLike) -> None:
    """Copy the tokenizer/generation/chat-template files of HF directory ``source`` into ``directory``
    (not config.json or safetensors indexes: writers produce their own)."""
    import shutil

    for item in sorted(Path(source).iterdir()):
        if (item.is_file() and item.suffix in COMPANION_SUFFIXES and item.name not in NOT_COMPANIONS
                and not item.name.endswith(".safetensors.index.json")):
            shutil.copy2(item, Path(directory) / item.name)


def read_config_json(directory: str | os.PathLike) -> dict:
    """The config.json dict of an HF directory, checked to be a transformers config (CheckpointError
    naming the file otherwise)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{Path(directory)}: no config.json (is this a HuggingFace model directory?)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise CheckpointError(f"{path}: no 'model_type' (not a transformers config)")
    return data
