"""The public path ``models.common.engine_push.push_to_vllm`` (README, docs/usage.md); the code lives in
``models/common/export/engine_push.py``."""

from models.common.export.engine_push import PushError, engine_in_process, push_to_vllm

__all__ = ["PushError", "engine_in_process", "push_to_vllm"]
