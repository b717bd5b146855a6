"""Blocks shared by the dense decoder architectures (Llama, Qwen2, Qwen2-VL's language model)."""

from models.common.config import ModelConfig, RopeConfig, UnsupportedConfigError
from models.common.sources import CheckpointError
from models.common.transformer import CausalLMOutput, ParallelCausalLM

__all__ = ["ModelConfig", "RopeConfig", "UnsupportedConfigError", "CheckpointError", "CausalLMOutput", "ParallelCausalLM"]
