"""What real Gated DeltaNet hybrid checkpoints hold beyond transformers' CausalLM model, read by
``build_parallel_model`` as transformers reads them: the MTP block (``mtp.*``, one multi-token-prediction
layer that transformers' CausalLM classes leave unread and pmz converts) is not loaded and does not stop
the load; the model's logits are still transformers' own."""

from __future__ import annotations

import glob
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.workers_qwen3_5 import configs, write_model


def _add_mtp(path: str, hidden: int) -> list[str]:
    """Write MTP-block tensors (names as in real Qwen3.5 checkpoints) into the checkpoint's one shard."""
    shard = f"{path}/model.safetensors"
    tensors = load_file(shard)
    g = torch.Generator().manual_seed(3)
    extra = {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.norm.weight": (hidden,),
             "mtp.pre_fc_norm_embedding.weight": (hidden,), "mtp.pre_fc_norm_hidden.weight": (hidden,),
             "mtp.layers.0.input_layernorm.weight": (hidden,)}
    for name, shape in extra.items():
        tensors[name] = torch.randn(shape, generator=g)
    save_file(tensors, shard, metadata={"format": "pt"})
    return sorted(extra)


@pytest.mark.parametrize("name", ["mixed"])
def test_mtp_block_is_left_unread(tmp_path, name):
    from transformers import AutoModelForCausalLM

    from models.qwen3_5 import build_parallel_model

    config = configs()[name]
    path = write_model(tmp_path, name, config, seed=5)
    added = _add_mtp(path, config.hidden_size)
    assert not json.loads((tmp_path / name / "config.json").read_text()).get("mtp_num_hidden_layers")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = build_parallel_model(path).eval()
    assert not any(n.startswith("mtp") for n, _ in model.named_parameters())
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, return_logits=True).logits
        ref = hf(ids).logits
    assert (ours - ref).abs().max().item() < 1e-5, added


VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16, spatial_merge_size=2)


def conditional_generation_checkpoint(root, name: str, tie: bool = False) -> tuple[str, object]:
    """A random ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` (text config from
    the layout tests, a tiny vision tower) saved by transformers: decoder under ``model.language_model.``,
    tower under ``model.visual.``, the text config under ``text_config``."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    if name == "qwen3_5":
        text, cls, config_cls = configs()["mixed"], Qwen3_5ForConditionalGeneration, Qwen3_5Config
    else:
        from tests.workers_qwen3_next import configs as moe_configs

        text, cls, config_cls = moe_configs()["qwen3_5_moe"], Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeConfig
    config = config_cls(text_config=text.to_dict(), vision_config=VISION, tie_word_embeddings=tie)
    torch.manual_seed(11)
    model = cls(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):
                p.normal_(-2.0, 0.5)
            elif "norm" in pname and "linear_attn" not in pname and "visual" not in pname:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    path = root / f"{name}_cg"
    model.save_pretrained(path)
    return str(path), model.eval()


@pytest.mark.parametrize("name,tie", [("qwen3_5", False), ("qwen3_5", True), ("qwen3_5_moe", False)])
def test_conditional_generation_checkpoint_loads_its_text_model(tmp_path, name, tie):
    """The text model of a conditional-generation checkpoint (``text_config``, ``model.language_model.*``)
    gives transformers' conditional-generation model's logits on text; the tower is left unread."""
    import importlib

    path, hf = conditional_generation_checkpoint(tmp_path, name, tie)
    names = load_file(f"{path}/model.safetensors").keys()
    assert ("lm_head.weight" in names) != tie
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("model.language_model.")
                                                                   for n in names)
    model = importlib.import_module(f"models.{name}").build_parallel_model(path).eval()
    vocab = hf.config.text_config.vocab_size
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids, return_logits=True).logits
        ref = hf(input_ids=ids).logits
    assert (ours - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("vision", [VISION, dict(VISION, depth=3, patch_size=2, temporal_patch_size=1,
                                                 spatial_merge_size=1, in_channels=1)])
def test_vision_tower_table_is_transformers_module(vision):
    """The tower's names and shapes (models/common/hybrid/vision.py) are transformers' own module's."""
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    from models.common.hybrid.vision import VISUAL_PREFIX, vision_tensors

    config = Qwen3_5VisionConfig(**vision)
    with torch.device("meta"):
        tower = Qwen3_5VisionModel(config)
    ref = [(VISUAL_PREFIX + n, tuple(p.shape)) for n, p in tower.state_dict().items()]
    assert list(vision_tensors(config)) == ref


def _tensors(directory) -> dict:
    out = {}
    for f in sorted(glob.glob(f"{directory}/*.safetensors")):
        out.update(load_file(f))
    return out


def test_conditional_generation_checkpoint_converts_with_its_tower(tmp_path):
    """pmz converts a conditional-generation checkpoint HF -> HF with the vision tower carried bitwise (copy
    path) or cast like every tensor (``--dtype``); the tower's shapes are checked against the vision config
    (Megatron targets: tests/test_convert_hybrid_vision.py)."""
    from converters.engine import convert
    from models.common.errors import CheckpointError

    path, _ = conditional_generation_checkpoint(tmp_path, "qwen3_5")
    source = _tensors(path)
    assert sum(n.startswith("model.visual.") for n in source) == 33
    convert(path, tmp_path / "same", to="hf", workers=1)
    same = _tensors(tmp_path / "same")
    assert same.keys() == source.keys()
    assert all(torch.equal(same[n], source[n]) for n in source)
    convert(path, tmp_path / "bf16", to="hf", dtype="bfloat16", workers=1)
    cast = _tensors(tmp_path / "bf16")
    assert cast.keys() == source.keys()
    assert all(torch.equal(cast[n], source[n].to(torch.bfloat16)) for n in source)

    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    tensors = load_file(f"{bad}/model.safetensors")
    tensors["model.visual.pos_embed.weight"] = tensors["model.visual.pos_embed.weight"][:-1].clone()
    save_file(tensors, f"{bad}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.visual\.pos_embed\.weight \(15, 32\) \(expected \(16, 32\)\)"):
        convert(bad, tmp_path / "bad_out", to="hf", workers=1)
