"""Every model folder's ``build_parallel_model`` (made by ``models/common/entry_point.py`` from one declaration,
or written out where a model needs more): importable as ``from models.X import build_parallel_model``, named
and documented as the folder's own function, with the keyword arguments users pass written out in its
signature (``help()`` shows them), and the hybrids' ``text_only``."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

FOLDERS = sorted(p.parent.name for p in Path(__file__).resolve().parents[1].glob("models/*/model.py"))
KEYWORDS = ["dtype", "device", "groups", "seed", "lora", "loss_chunk_tokens", "compile"]
HYBRIDS = {"qwen3_5", "qwen3_5_moe"}


def test_every_folder_is_covered():
    assert {"llama", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next", "qwen2_vl", "qwen2_5_vl", "qwen3_5",
            "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe"} <= set(FOLDERS)


@pytest.mark.parametrize("folder", FOLDERS)
def test_entry_point_signature_name_and_doc(folder):
    package = importlib.import_module(f"models.{folder}")
    fn = package.build_parallel_model
    assert fn is importlib.import_module(f"models.{folder}.model").build_parallel_model
    assert fn.__module__ == f"models.{folder}.model" and fn.__name__ == "build_parallel_model"
    params = inspect.signature(fn).parameters
    assert list(params)[:2] == ["source", "parallel_config"]
    assert params["parallel_config"].default is None
    for name in KEYWORDS:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, (folder, name)
    assert ("text_only" in params) == (folder in HYBRIDS), folder
    assert not any(p.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
                   for p in params.values())
    assert "Build this rank's" in fn.__doc__ and "init_process_group" in fn.__doc__
