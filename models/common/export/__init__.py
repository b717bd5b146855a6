"""Getting weights out of a live parallel model: flat export buckets (``buckets.py``: ``iter_export``),
checkpoint writers (``saving.py``: HF directories and vLLM ``sharded_state``), LoRA adapter files
(``lora_adapter.py``) and the push into a running vLLM engine (``engine_push.py``). Like training, it
takes the model as an argument and never imports the causal LM."""

from models.common.export.buckets import ExportError

__all__ = ["ExportError"]
