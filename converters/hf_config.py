"""HF ``config.json`` as plain data: read, built from Megatron args, written — without transformers.

Importing transformers' config classes costs ~85 MiB and ~1.5 s (it pulls in torch._dynamo); a
converter only needs the JSON. ``HFConfig`` gives attribute access over the dict (missing keys read
as None, the architectures' defaults apply in ``models/*/config.py``), and the JSON written is what
transformers' ``save_pretrained`` writes for the fields that matter, so ``from_pretrained`` loads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.common.errors import CheckpointError
from models.common.hf_files import read_config_json

ARCHITECTURE_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class HFConfig:
    """Attribute view of a config.json dict (absent keys -> None)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.__dict__["data"] = dict(data)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.__dict__["data"].get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__["data"][name] = value

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__["data"])

    def save(self, directory: str | Path, dtype: Any = None) -> None:
        """``config.json``; ``dtype`` (a torch dtype or its name, "bfloat16") sets ``dtype``/``torch_dtype``."""
        data = self.to_dict()
        if dtype is not None:
            data["dtype"] = data["torch_dtype"] = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        Path(directory, "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_hf_config(directory: str | Path) -> HFConfig:
    """config.json of an HF directory; CheckpointError naming the file when missing or malformed."""
    path = Path(directory) / "config.json"
    data = read_config_json(directory)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        if not isinstance(data.get(key), int) or data[key] <= 0:
            raise CheckpointError(f"{path}: '{key}' must be a positive integer, found {data.get(key)!r}")
    return HFConfig(data)


def config_from_fields(model_type: str, **fields: Any) -> HFConfig:
    """A complete config.json for a Llama/Qwen2 model from its fields (used for Megatron sources)."""
    base = {"architectures": [ARCHITECTURE_CLASS[model_type]], "model_type": model_type, "hidden_act": "silu",
            "initializer_range": 0.02, "use_cache": True, "attention_dropout": 0.0}
    if model_type == "llama":
        base.update(pretraining_tp=1, attention_bias=False, mlp_bias=False)
    else:
        base.update(use_sliding_window=False, sliding_window=None, max_window_layers=fields["num_hidden_layers"])
    base.update(fields)
    rope = base.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0}
    base["rope_parameters"] = rope
    base["rope_theta"] = rope["rope_theta"]
    return HFConfig(base)
