"""Bad input to the Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), refused by
``build_parallel_model`` in one line naming the numbers (or tensor, file and shapes), before any process
group exists: every check reads only the config and the checkpoint's headers, so every rank of a job
reaches the same verdict at once instead of some hanging in a collective.

  * configs: a ``layer_types`` entry the blocks do not compute, ``layer_types`` of the wrong length, linear
    value heads that are not a multiple of the key heads, attention heads not divisible by the KV heads
    (``models/common/hybrid/config.py``, ``ParallelConfig.validate``);
  * layouts: a TP that cannot split the linear key-head groups (value heads go with their group, so they
    split whenever the key heads do), a Ulysses size that cannot split the key-head groups of a TP rank;
    CP splits tokens, not heads, so any CP size is accepted;
  * checkpoints: a tensor whose shape does not match the config (the conv kernel, ``A_log``/``dt_bias`` of
    the wrong length, the gated norm, Qwen3-Next's interleaved ``in_proj_qkvz``/``in_proj_ba``) named with
    its file and both shapes.

The good configs are the ones the layout tests run (tests/workers_qwen3_5.py, tests/workers_qwen3_next.py).
"""

from __future__ import annotations

import importlib
import shutil

import pytest
import torch

from models.common.config import UnsupportedConfigError
from models.common.sources import CheckpointError
from parallel import ParallelConfig
from parallel.config import ParallelConfigError

MODELS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def _hf_config(name: str):
    """A fresh transformers config of ``name`` (callers change it)."""
    if name == "qwen3_5":
        from tests.workers_qwen3_5 import configs

        return configs()["mixed"]
    from tests.workers_qwen3_next import configs

    return configs()[name]


def _model_config(name: str):
    """Our config of ``name`` (its own ``model_config``: the MoE sizes included)."""
    return importlib.import_module(f"models.{name}.config").model_config(_hf_config(name))


def _refused(name: str, source, pconfig: ParallelConfig | None = None) -> str:
    """The one-line message ``build_parallel_model`` raises for ``source``; no process group was made."""
    build = importlib.import_module(f"models.{name}").build_parallel_model
    with pytest.raises((UnsupportedConfigError, ParallelConfigError, CheckpointError)) as info:
        build(source, pconfig)
    assert not torch.distributed.is_initialized()
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("name", MODELS)
def test_unknown_or_missing_layer_types_refused(name):
    cfg = _hf_config(name)
    cfg.layer_types = ["linear_attention", "mamba", "full_attention", "sliding_attention"]
    assert _refused(name, cfg) == (f"{name}: layer_types has 'mamba', 'sliding_attention' (layers [1, 3]); "
                                   f"known: linear_attention, full_attention")
    cfg.layer_types = ["linear_attention", "full_attention"]
    assert _refused(name, cfg) == f"{name}: layer_types has 2 entries for num_hidden_layers=4"


@pytest.mark.parametrize("name", MODELS)
def test_head_counts_that_do_not_divide_refused(name):
    cfg = _hf_config(name)
    hk = cfg.linear_num_key_heads
    cfg.linear_num_value_heads = hk + 1
    assert _refused(name, cfg) == (f"{name}: linear_num_value_heads={hk + 1} is not a multiple of "
                                   f"linear_num_key_heads={hk}")
    cfg = _hf_config(name)
    cfg.num_key_value_heads = 3
    assert _refused(name, cfg).endswith(": num_attention_heads=4 is not divisible by num_key_value_heads=3")


# (model, layout, the problem named); every config: 4 attention heads, 2 KV heads; linear key heads 2 (Qwen3.5,
# Qwen3.5-MoE) or 4 (Qwen3-Next)
LAYOUTS = [
    ("qwen3_5", dict(tp=4), "linear_num_key_heads=2 is not divisible by tp=4"),
    ("qwen3_5_moe", dict(tp=4), "linear_num_key_heads=2 is not divisible by tp=4"),
    ("qwen3_5", dict(tp=2, ulysses=2), "ulysses=2 needs the linear-attention key heads per TP rank "
                                       "(linear_num_key_heads=2 / tp=2 = 1) to be divisible by it"),
    ("qwen3_5_moe", dict(ulysses=4), "ulysses=4 needs the linear-attention key heads per TP rank "
                                     "(linear_num_key_heads=2 / tp=1 = 2) to be divisible by it"),
    ("qwen3_next", dict(tp=8), "linear_num_key_heads=4 is not divisible by tp=8"),
    ("qwen3_next", dict(tp=2, ulysses=4), "ulysses=4 needs the linear-attention key heads per TP rank "
                                          "(linear_num_key_heads=4 / tp=2 = 2) to be divisible by it"),
]


@pytest.mark.parametrize("name,kwargs,problem", LAYOUTS)
def test_layouts_that_cannot_split_the_linear_heads_refused(name, kwargs, problem):
    pconfig = ParallelConfig(**kwargs)
    cfg = _model_config(name)
    with pytest.raises(ParallelConfigError) as info:
        pconfig.validate(cfg, world_size=pconfig.model_parallel_size)
    assert problem in str(info.value) and "world size" not in str(info.value)
    assert problem in _refused(name, _hf_config(name), pconfig)  # the builder, before any group


@pytest.mark.parametrize("name", MODELS)
def test_sequence_splits_that_keep_heads_whole_accepted(name):
    """CP splits tokens only (any size, odd too); Ulysses 2 splits the key-head groups of every config."""
    cfg = _model_config(name)
    for kwargs in (dict(cp=3), dict(cp=4), dict(ulysses=2), dict(cp=2, ulysses=2)):
        pconfig = ParallelConfig(**kwargs)
        pconfig.validate(cfg, world_size=pconfig.model_parallel_size)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from tests.workers_qwen3_5 import write_model

    root = tmp_path_factory.mktemp("hybrid_bad_input")
    return {name: write_model(root, name, _hf_config(name), seed=i) for i, name in enumerate(MODELS)}


# (model, tensor of layer 1 (linear attention), how it is cut, its shape, the config's)
TENSORS = [
    ("qwen3_5", "conv1d.weight", lambda t: t[..., :3], (160, 1, 3), (160, 1, 4)),  # kernel 3 for the config's 4
    ("qwen3_5", "A_log", lambda t: t[:3], (3,), (4,)),
    ("qwen3_5", "norm.weight", lambda t: torch.cat([t, t]), (48,), (24,)),
    ("qwen3_5_moe", "dt_bias", lambda t: t[:2], (2,), (4,)),
    ("qwen3_5_moe", "in_proj_qkv.weight", lambda t: t[:-24], (136, 64), (160, 64)),
    ("qwen3_next", "in_proj_qkvz.weight", lambda t: t[:-16], (368, 64), (384, 64)),
    ("qwen3_next", "in_proj_ba.weight", lambda t: t[:8], (8, 64), (16, 64)),
    ("qwen3_next", "conv1d.weight", lambda t: torch.cat([t, t[..., :1]], -1), (256, 1, 5), (256, 1, 4)),
]


@pytest.mark.parametrize("name,tensor,cut,shape,expected", TENSORS)
def test_checkpoint_tensor_that_does_not_match_the_config_refused(dirs, tmp_path, name, tensor, cut, shape,
                                                                  expected):
    from safetensors.torch import load_file, save_file

    src = tmp_path / name
    shutil.copytree(dirs[name], src)
    tensors = load_file(str(src / "model.safetensors"))
    full = f"model.layers.1.linear_attn.{tensor}"
    tensors[full] = cut(tensors[full]).clone()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert _refused(name, str(src)) == (f"{src}: 1 tensor(s) with the wrong shape: {full} {shape} "
                                        f"(expected {expected}) in model.safetensors")
