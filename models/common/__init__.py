"""What the architectures share. The model description: ``config``, ``weight_map``/``weights``,
``sources``/``hf_files``, ``architecture``, ``vllm_format`` (plain data where the converters need it);
above it the model blocks (``blocks/``), training (``training/``) and export (``export/``); on top the
causal LM (``causal_lm.py``) and ``build_model`` (``builder.py``).

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
        from models.common import causal_lm

        return getattr(causal_lm, name)
    raise AttributeError(f"module 'models.common' has no attribute {name!r}")
