"""Qwen3.5 / Qwen3.5-MoE conditional-generation checkpoints (text model, vision tower, MTP block) in Megatron
formats as Megatron-Bridge 0.6.2's ``Qwen3VLModel`` names them: HF -> Megatron legacy / torch_dist -> HF bitwise,
reshards bitwise, the tower on the first pipeline stage, its ``qkv`` per head (checked against an order
re-derived here from megatron-core's ``linear_qkv`` definition, not the converter's function); against real
Megatron-Bridge 0.6.2 (tests/bridge_qwen35_vl_oracle.py, one subprocess): Bridge's own checkpoint of the model
converts to HF bitwise, and our ``--to megatron-dist`` output has Bridge's keys and shapes and loads strictly into
the Qwen3VLModel Bridge builds, every weight bitwise what Bridge imports from HF."""

from __future__ import annotations

import glob
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_hybrid_checkpoints import VISION, conditional_generation_checkpoint


def _tensors(directory) -> dict:
    out = {}
    for f in sorted(glob.glob(f"{directory}/*.safetensors")):
        out.update(load_file(f))
    return out


def _trained_norms(path: str, mtp: bool) -> dict:
    """Give the gated norms of the linear layers weights around 1 as trained ones have (Megatron holds ``w - 1``:
    exact both ways for w in [0.5, 2]) and, with ``mtp``, add a random MTP block (every tensor the converters'
    map names for one MTP layer); returns the checkpoint's tensors."""
    from converters.formats.hf_config import read_hf_config
    from converters.layout.model import architecture_for, conversion_weight_map

    config = read_hf_config(path)
    arch = architecture_for(config.model_type, path)
    cfg = arch.model_config(config)
    shard = f"{path}/model.safetensors"
    tensors = load_file(shard)
    g = torch.Generator().manual_seed(7)
    for name in [n for n in tensors if n.endswith("linear_attn.norm.weight")]:
        tensors[name] = (1 + 0.1 * torch.randn(tensors[name].shape, generator=g)).clamp(0.6, 1.9)
    for entry in conversion_weight_map(arch, cfg, 1).mtp_entries() if mtp else ():
        for j, name in enumerate(entry.hf):
            tensors[name] = torch.randn(entry.shapes[j % entry.parts], generator=g) * 0.1
    save_file(tensors, shard, metadata={"format": "pt"})
    return tensors


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (HF directory with the MTP block, its tensors); ``name + "_plain"`` the same model without MTP
    (Bridge builds the MTP layer from the last decoder layer's spec, and these configs end in a linear layer)."""
    import shutil

    root = tmp_path_factory.mktemp("cg")
    out = {}
    for name in ("qwen3_5", "qwen3_5_moe"):
        plain, _ = conditional_generation_checkpoint(root, name)
        out[name + "_plain"] = (plain, _trained_norms(plain, mtp=False))
        shutil.copytree(plain, root / f"{name}_mtp")
        out[name] = (str(root / f"{name}_mtp"), _trained_norms(str(root / f"{name}_mtp"), mtp=True))
    return out


def _per_head(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """megatron-core's ``linear_qkv`` with one query group per head: rows [q_h; k_h; v_h] for h in order."""
    q, k, v = qkv.chunk(3, dim=0)
    return torch.cat([torch.cat([q.chunk(heads)[h], k.chunk(heads)[h], v.chunk(heads)[h]]) for h in range(heads)])


def _legacy_state(root, t: int, p: int) -> dict:
    (it,) = glob.glob(f"{root}/iter_*") + glob.glob(f"{root}/release")
    return torch.load(f"{it}/mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt", weights_only=False)["model"]


def test_legacy_tp2_pp2_round_trip(tmp_path, checkpoints):
    """HF -> legacy TP2 x PP2 -> HF bitwise (text, tower, MTP; config.json as the source's); the tower lives on
    stage 0 under vision_model.* per TP rank as megatron-core splits it, the text under language_model.*."""
    from converters.engine import convert

    path, source = checkpoints["qwen3_5"]
    convert(path, tmp_path / "m", to="megatron", tp=2, pp=2, workers=1)
    first, last = _legacy_state(tmp_path / "m", 0, 0), _legacy_state(tmp_path / "m", 1, 1)
    assert any(k.startswith("vision_model.") for k in first) and not any(k.startswith("vision_model.") for k in last)
    assert "language_model.embedding.word_embeddings.weight" in first
    assert "language_model.mtp.layers.0.eh_proj.weight" in last
    heads, h = VISION["num_heads"], VISION["hidden_size"]
    qkv = _per_head(source["model.visual.blocks.1.attn.qkv.weight"], heads)
    assert torch.equal(first["vision_model.decoder.layers.1.self_attention.linear_qkv.weight"], qkv[: 3 * h // 2])
    assert torch.equal(_legacy_state(tmp_path / "m", 1, 0)["vision_model.decoder.layers.1.self_attention.linear_proj"
                                                           ".weight"],
                       source["model.visual.blocks.1.attn.proj.weight"][:, h // 2:])
    assert torch.equal(first["vision_model.merger.patch_norm.bias"], source["model.visual.merger.norm.bias"])
    args = torch.load(glob.glob(f"{tmp_path}/m/*/mp_rank_00_000/model_optim_rng.pt")[0], weights_only=False)["args"]
    assert args.hf_conditional_generation["model_type"] == "qwen3_5"
    convert(tmp_path / "m", tmp_path / "back", to="hf", workers=1)
    back = _tensors(tmp_path / "back")
    assert back.keys() == source.keys()
    assert [n for n in source if not torch.equal(back[n], source[n])] == []
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads(
        (tmp_path / "m" / "hf_config" / "config.json").read_text())


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_dist_round_trip_and_reshard(tmp_path, checkpoints, name):
    """HF -> torch_dist (Qwen3VLModel's keys: tower blocks stacked [depth, ...], text per layer under
    language_model.) -> HF bitwise; torch_dist -> legacy TP2 -> HF bitwise too, and without the hf_config/
    sidecar the args alone give a conditional-generation config.json back."""
    from converters.engine import convert

    path, source = checkpoints[name]
    convert(path, tmp_path / "d", to="megatron-dist", tp=2, workers=1)
    from torch.distributed.checkpoint import FileSystemReader

    (it,) = glob.glob(f"{tmp_path}/d/iter_*") + glob.glob(f"{tmp_path}/d/release")
    meta = FileSystemReader(it).read_metadata().state_dict_metadata
    depth, h = VISION["depth"], VISION["hidden_size"]
    assert tuple(meta["vision_model.decoder.layers.self_attention.linear_qkv.weight"].size) == (depth, 3 * h, h)
    assert tuple(meta["vision_model.decoder.layers.mlp.linear_fc1.layer_norm_bias"].size) == (depth, h)
    assert tuple(meta["vision_model.pos_embed.weight"].size) == (VISION["num_position_embeddings"], h)
    assert "language_model.decoder.layers.0.self_attention.in_proj.weight.query" in meta
    assert "language_model.mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight" in meta
    assert "vision_model.decoder.layers.self_attention.linear_qkv._extra_state/shard_1_2" in meta
    convert(tmp_path / "d", tmp_path / "back", to="hf", workers=1)
    back = _tensors(tmp_path / "back")
    assert back.keys() == source.keys()
    assert [n for n in source if not torch.equal(back[n], source[n])] == []
    convert(tmp_path / "d", tmp_path / "l", to="megatron", tp=2, workers=1)
    import shutil

    shutil.rmtree(tmp_path / "l" / "hf_config")
    convert(tmp_path / "l", tmp_path / "back2", to="hf", workers=1)
    back2 = _tensors(tmp_path / "back2")
    assert [n for n in source if not torch.equal(back2[n], source[n])] == []
    config = json.loads((tmp_path / "back2" / "config.json").read_text())
    original = json.loads((tmp_path / "d" / "hf_config" / "config.json").read_text())
    assert config["model_type"] == original["model_type"] and config["vision_config"] == original["vision_config"]
    assert config["text_config"]["layer_types"] == original["text_config"]["layer_types"]


def test_tp_must_divide_vision_heads(tmp_path, checkpoints):
    """megatron-core splits the tower's attention by heads: a TP that does not divide them is refused before
    anything is written (a tower of one head; the text model alone would take TP 2)."""
    import shutil

    from converters.engine import convert

    path, _ = checkpoints["qwen3_5"]
    one = tmp_path / "one_head"
    shutil.copytree(path, one)
    config = json.loads((one / "config.json").read_text())
    config["vision_config"]["num_heads"] = 1
    (one / "config.json").write_text(json.dumps(config))
    for target in ("megatron", "megatron-dist"):
        with pytest.raises(ValueError, match=r"--tp 2 does not divide the vision tower's num_heads=1"):
            convert(one, tmp_path / target, to=target, tp=2, workers=1)
        assert not (tmp_path / target).exists()


def test_against_megatron_bridge(tmp_path, checkpoints):
    """Real Megatron-Bridge 0.6.2 builds Qwen3VLModel from the HF directories (Qwen3.5 and Qwen3.5-MoE):
    its checkpoint -> pmz -> HF is the original HF bitwise; our --to megatron-dist output (TP 2) holds exactly
    Bridge's keys with its global shapes (tower stacked, text per layer, _extra_state items alike) and loads into
    Bridge's model with megatron-core's strict dist_checkpointing.load, every weight bitwise what Bridge imports."""
    from converters.engine import convert
    from tests.bridge_run import run_bridge_oracle

    jobs = [{"op": "write", "hf": checkpoints["qwen3_5_plain"][0], "out": str(tmp_path / "bridge"), "mtp": False}]
    for name in ("qwen3_5", "qwen3_5_moe"):
        convert(checkpoints[name + "_plain"][0], tmp_path / f"ours_{name}", to="megatron-dist", tp=2, workers=1)
        jobs.append({"op": "load", "ckpt": str(tmp_path / f"ours_{name}" / "release"), "mtp": False,
                     "hf": checkpoints[name + "_plain"][0], "via": "dist_checkpointing"})
    written, *loads = run_bridge_oracle("bridge_qwen35_vl_oracle.py", jobs, tmp_path, timeout=600)
    for name, load in zip(("qwen3_5", "qwen3_5_moe"), loads):
        assert load["compared"] > 70 and (load["mismatched"], load["missing"], load["unexpected"]) == ([], [], []), \
            (name, load)
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(tmp_path / "ours_qwen3_5" / "release")).read_metadata().state_dict_metadata
    # Bridge keeps the vocabulary unpadded and its common state inside the checkpoint; pmz pads the rows as
    # Megatron-LM does (a multiple of 128 * tp) and writes common.pt
    vocab = ("language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight")
    ours = {k: (list(v.size)[-1:] if k in vocab else list(v.size)) if hasattr(v, "size") else "object"
            for k, v in meta.items()}
    theirs = {k: v[-1:] if k in vocab else v for k, v in written["keys"].items() if not k.startswith("common_state")}
    assert ours == theirs
    assert sum(k.startswith("vision_model.") for k in theirs) > 20
    plain, source = checkpoints["qwen3_5_plain"]
    convert(tmp_path / "bridge", tmp_path / "bridge_hf", to="hf", hf_config=plain, workers=1)
    back = _tensors(tmp_path / "bridge_hf")
    assert back.keys() == source.keys()
    assert [n for n in source if not torch.equal(back[n], source[n])] == []
