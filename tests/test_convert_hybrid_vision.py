"""Qwen3.5 / Qwen3.5-MoE conditional-generation checkpoints (text model, vision tower, MTP block) in Megatron
formats as Megatron-Bridge 0.6.2's ``Qwen3VLModel`` names them: HF -> Megatron legacy / torch_dist -> HF bitwise,
reshards bitwise, the tower on the first pipeline stage, its ``qkv`` per head (checked against an order
re-derived here from megatron-core's ``linear_qkv`` definition, not the converter's function); against real
Megatron-Bridge 0.6.2 (tests/bridge_qwen35_vl_oracle.py, one subprocess): Bridge's own checkpoint of the model
converts to HF bitwise, and our ``--to megatron-dist`` output has Bridge's keys and shapes and loads strictly into
the Qwen3VLModel Bridge builds, every weight bitwise what Bridge imports from HF; our ``--to megatron-bridge``
output (dense TP2, MoE PP2, MTP included) loads with Bridge's own loader (``load_model_config`` on our
run_config.yaml naming its Qwen3.5-VL provider, ``build_and_load_model``) strictly and bitwise, the provider's
fields equal those Bridge derives from HF, keys and run_config.yaml fields equal Bridge's own checkpoint's, and
pmz reads it back to the HF tensors and config.json bitwise."""

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


def _bridge_checkpoint(root, name: str) -> str:
    """A conditional-generation checkpoint Megatron-Bridge builds with its MTP block: the layout tests' text
    config with the last layer full attention (megatron-core builds the MTP layer from the last layer's spec),
    ``text_config.mtp_num_hidden_layers: 1`` (Bridge's provider reads it there) and a random MTP block."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    from tests.workers_qwen3_5 import configs
    from tests.workers_qwen3_next import configs as moe_configs

    text = configs()["mixed"] if name == "qwen3_5" else moe_configs()["qwen3_5_moe"]
    text.layer_types = ["linear_attention"] * (text.num_hidden_layers - 1) + ["full_attention"]
    text.mtp_num_hidden_layers = 1
    text.vocab_size = 102  # Bridge builds the vocabulary unpadded: it must divide by BRIDGE_LAYOUTS' tp
    cls, config_cls = ((Qwen3_5ForConditionalGeneration, Qwen3_5Config) if name == "qwen3_5" else
                       (Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeConfig))
    torch.manual_seed(13)
    path = root / f"{name}_bridge"
    cls(config_cls(text_config=text.to_dict(), vision_config=VISION)).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1 and config["text_config"]["layer_types"][-1] == \
        "full_attention", config["text_config"]
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (HF directory with the MTP block, its tensors); ``name + "_plain"`` the same model without MTP
    (Bridge builds the MTP layer from the last decoder layer's spec, and these configs end in a linear layer);
    ``name + "_bridge"`` one Bridge builds with MTP (``_bridge_checkpoint``)."""
    import shutil

    root = tmp_path_factory.mktemp("cg")
    out = {}
    for name in ("qwen3_5", "qwen3_5_moe"):
        plain, _ = conditional_generation_checkpoint(root, name)
        out[name + "_plain"] = (plain, _trained_norms(plain, mtp=False))
        shutil.copytree(plain, root / f"{name}_mtp")
        out[name] = (str(root / f"{name}_mtp"), _trained_norms(str(root / f"{name}_mtp"), mtp=True))
        path = _bridge_checkpoint(root, name)
        out[name + "_bridge"] = (path, _trained_norms(path, mtp=True))
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


# layouts of --to megatron-bridge checked against Bridge: the dense model TP2, the MoE model PP2
BRIDGE_LAYOUTS = {"qwen3_5": {"tp": 2}, "qwen3_5_moe": {"pp": 2}}
PROVIDERS = {"qwen3_5": "megatron.bridge.models.qwen_vl.qwen35_vl_provider.Qwen35VLModelProvider",
             "qwen3_5_moe": "megatron.bridge.models.qwen_vl.qwen35_vl_provider.Qwen35VLMoEModelProvider"}
# run_config.yaml fields that record the parallel layout (ours: the one converted to) or that the oracle's CPU run
# sets otherwise in Bridge's own file (bridge_gdn_oracle._cpu); provider fields Bridge derives from the HF path
RUNTIME_FIELDS = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "moe_token_dispatcher_type",
                  "moe_permute_fusion"}
CONFIG_FIELDS_NOT_WRITTEN = {"hf_model_id"}


@pytest.fixture(scope="module")
def bridge(tmp_path_factory, checkpoints):
    """One run of real Megatron-Bridge 0.6.2 (tests/bridge_qwen35_vl_oracle.py) for the module: it writes its own
    checkpoint of the MTP-less Qwen3.5 model and of both ``_bridge`` models (MTP included), loads our
    --to megatron-dist output of both MTP-less models into the Qwen3VLModel it builds (megatron-core's strict
    dist_checkpointing.load), and loads our --to megatron-bridge output of both ``_bridge`` models with its own
    loader (``load_model_config`` on our run_config.yaml, ``build_and_load_model``)."""
    from converters.engine import convert
    from tests.bridge_run import run_bridge_oracle

    root = tmp_path_factory.mktemp("cg_bridge")
    jobs = [{"op": "write", "hf": checkpoints["qwen3_5_plain"][0], "out": str(root / "bridge"), "mtp": False}]
    jobs += [{"op": "write", "hf": checkpoints[f"{name}_bridge"][0], "out": str(root / f"real_{name}")}
             for name in BRIDGE_LAYOUTS]
    for name in ("qwen3_5", "qwen3_5_moe"):
        convert(checkpoints[name + "_plain"][0], root / f"ours_{name}", to="megatron-dist", tp=2, workers=1)
        jobs.append({"op": "load", "ckpt": str(root / f"ours_{name}" / "release"), "mtp": False,
                     "hf": checkpoints[name + "_plain"][0], "via": "dist_checkpointing"})
    ours = {name: convert(checkpoints[f"{name}_bridge"][0], root / f"mb_{name}", to="megatron-bridge", workers=1,
                          **layout) for name, layout in BRIDGE_LAYOUTS.items()}
    jobs += [{"op": "load", "ckpt": str(ours[name]), "hf": checkpoints[f"{name}_bridge"][0]} for name in ours]
    written, *real, dense, moe, mb_dense, mb_moe = run_bridge_oracle("bridge_qwen35_vl_oracle.py", jobs, root,
                                                                     timeout=600)
    return {"root": root, "written": written, "real": dict(zip(BRIDGE_LAYOUTS, real)),
            "dist_loads": {"qwen3_5": dense, "qwen3_5_moe": moe}, "ours": ours,
            "bridge_loads": {"qwen3_5": mb_dense, "qwen3_5_moe": mb_moe}}


def test_against_megatron_bridge(bridge, checkpoints):
    """Real Megatron-Bridge 0.6.2 builds Qwen3VLModel from the HF directories (Qwen3.5 and Qwen3.5-MoE):
    its checkpoint -> pmz -> HF is the original HF bitwise; our --to megatron-dist output (TP 2) holds exactly
    Bridge's keys with its global shapes (tower stacked, text per layer, _extra_state items alike) and loads into
    Bridge's model with megatron-core's strict dist_checkpointing.load, every weight bitwise what Bridge imports."""
    from converters.engine import convert

    root, written = bridge["root"], bridge["written"]
    for name, load in bridge["dist_loads"].items():
        assert load["compared"] > 70 and (load["mismatched"], load["missing"], load["unexpected"]) == ([], [], []), \
            (name, load)
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(root / "ours_qwen3_5" / "release")).read_metadata().state_dict_metadata
    # Bridge keeps the vocabulary unpadded and its common state inside the checkpoint; pmz pads the rows as
    # Megatron-LM does (a multiple of 128 * tp) and writes common.pt
    vocab = ("language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight")
    ours = {k: (list(v.size)[-1:] if k in vocab else list(v.size)) if hasattr(v, "size") else "object"
            for k, v in meta.items()}
    theirs = {k: v[-1:] if k in vocab else v for k, v in written["keys"].items() if not k.startswith("common_state")}
    assert ours == theirs
    assert sum(k.startswith("vision_model.") for k in theirs) > 20
    plain, source = checkpoints["qwen3_5_plain"]
    convert(root / "bridge", root / "bridge_hf", to="hf", hf_config=plain, workers=1)
    back = _tensors(root / "bridge_hf")
    assert back.keys() == source.keys()
    assert [n for n in source if not torch.equal(back[n], source[n])] == []


# ------------------------------------------------------------------------------ --to megatron-bridge


@pytest.mark.parametrize("name", list(BRIDGE_LAYOUTS))
def test_real_bridge_loads_our_megatron_bridge_output(bridge, name):
    """Bridge's own loader instantiates the Qwen3.5-VL provider our run_config.yaml names, with the public
    fields (vision_config included) its bridge derives from the HF directory, and loads our checkpoint strictly
    into the Qwen3VLModel it builds: every tensor (tower, text, MTP) bitwise what it imports from HF."""
    load = bridge["bridge_loads"][name]
    assert load["loader"] == PROVIDERS[name], load
    assert load["compared"] > 80 and (load["mismatched"], load["missing"], load["unexpected"]) == ([], [], []), load
    assert set(load["config_diff"]) <= CONFIG_FIELDS_NOT_WRITTEN, load["config_diff"]
    keys = _bridge_keys(bridge["ours"][name])
    assert any(k.startswith("language_model.mtp.layers.0.") for k in keys)
    assert any(k.startswith("vision_model.decoder.layers.") for k in keys)


def _bridge_keys(ckpt) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    (it,) = glob.glob(f"{ckpt}/iter_*")
    meta = FileSystemReader(it).read_metadata().state_dict_metadata
    return {k: list(v.size) if hasattr(v, "size") else "object" for k, v in meta.items()}


@pytest.mark.parametrize("name", list(BRIDGE_LAYOUTS))
def test_megatron_bridge_output_is_bridges(bridge, name):
    """Our --to megatron-bridge checkpoint holds Bridge's own keys, global shapes (vocabulary unpadded) and
    ``_extra_state`` items (but the common state: we write common.pt); every field of our run_config.yaml's
    ``model`` equals the one in Bridge's own file for the same HF directory (``vision_config``: each field we
    write equals Bridge's record, which adds transformers' defaults), but the parallel layout and the oracle's
    CPU switches."""
    import yaml

    ours = _bridge_keys(bridge["ours"][name])
    theirs = {k: v for k, v in bridge["real"][name]["keys"].items() if not k.startswith("common_state")}
    assert ours == theirs
    (it,) = glob.glob(f"{bridge['ours'][name]}/iter_*")
    mine = yaml.safe_load(open(f"{it}/run_config.yaml"))["model"]
    real = yaml.safe_load(bridge["real"][name]["run_config"])["model"]
    assert mine["_target_"] == real["_target_"] == PROVIDERS[name]
    vision = mine.pop("vision_config")
    assert {k: (v, real["vision_config"].get(k)) for k, v in vision.items() if real["vision_config"].get(k) != v} == {}
    differ = {k: (v, real.get(k, "absent")) for k, v in mine.items() if k not in RUNTIME_FIELDS and real.get(k) != v}
    assert not differ, differ
    assert mine["mtp_num_layers"] == 1 and mine["position_embedding_type"] == "mrope"
    layout = BRIDGE_LAYOUTS[name]
    assert (mine["tensor_model_parallel_size"], mine["pipeline_model_parallel_size"]) == \
        (layout.get("tp", 1), layout.get("pp", 1))


@pytest.mark.parametrize("name", list(BRIDGE_LAYOUTS))
def test_megatron_bridge_round_trip(bridge, checkpoints, tmp_path, name):
    """HF -> --to megatron-bridge -> HF: the tower, MTP and text tensors and config.json, bitwise."""
    from converters.engine import convert

    path, source = checkpoints[f"{name}_bridge"]
    out = convert(bridge["ours"][name], tmp_path / "hf", to="hf", workers=1)
    back = _tensors(out)
    assert back.keys() == source.keys()
    assert any(k.startswith("mtp.") for k in back) and any(k.startswith("model.visual.") for k in back)
    assert [n for n in source if not torch.equal(back[n], source[n])] == []
    assert (out / "config.json").read_bytes() == open(f"{path}/config.json", "rb").read()


def test_tower_depth_counts_each_map_once_and_never_confuses_two():
    """``tower_depth`` keeps the depths of the last few maps it was asked about (the planners ask once per tower
    tensor: a scan of the map each time made a Qwen3.5-VL HF -> torch_dist conversion spend 0.3 s in it). Asked
    about more maps than it keeps, in turns, each map still gets its own block and DeepStack counts, counted here
    from the names built."""
    from types import SimpleNamespace

    from converters.layout.hybrid import _DEPTHS_KEPT, tower_depth
    from models.common.hybrid.vision import TOWER_DEEPSTACK, TOWER_LAYERS

    def fake_map(blocks: int, mergers: int):
        params = ("mlp.linear_fc1.weight", "input_norm.weight")
        names = [f"{TOWER_LAYERS}{b}.{p}" for b in range(blocks) for p in params]
        names += [f"{TOWER_DEEPSTACK}{k}.linear_fc2.weight" for k in range(mergers)]
        names.append("embedding.word_embeddings.weight")
        entries = tuple(SimpleNamespace(megatron=n) for n in names)
        return SimpleNamespace(first_entries=entries[: len(entries) // 2], carried_entries=entries[len(entries) // 2:])

    shapes = [(b, b % 3) for b in range(1, 2 * _DEPTHS_KEPT + 3)]
    maps = [fake_map(*s) for s in shapes]
    for _ in range(2):
        for wmap, (blocks, mergers) in zip(maps, shapes):
            assert tower_depth(wmap) == blocks
            assert tower_depth(wmap, f"{TOWER_DEEPSTACK}0.linear_fc2") == mergers
            assert tower_depth(wmap, f"{TOWER_LAYERS}0.mlp.linear_fc1") == blocks
    assert tower_depth(SimpleNamespace(first_entries=(SimpleNamespace(megatron=None),))) == 0
