"""Blocks shared by the dense decoder architectures (Llama, Qwen2, Qwen2-VL's language model).

The names below load on first use: the plain-data modules of this package (config, weight map,
architecture) are imported by the converters' copy path, which must not load torch.
"""

from models.common.config import ModelConfig, RopeConfig, UnsupportedConfigError

__all__ = ["ModelConfig", "RopeConfig", "UnsupportedConfigError", "CheckpointError", "CausalLMOutput",
           "ParallelCausalLM"]


def __getattr__(name: str):
    if name == "CheckpointError":
        from models.common.sources import CheckpointError

        return CheckpointError
    if name in ("CausalLMOutput", "ParallelCausalLM"):
        from models.common import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'models.common' has no attribute {name!r}")
