"""Qwen3-VL and Qwen3-VL-MoE in Megatron formats as Megatron-Bridge 0.6.2's ``Qwen3VLModel`` names them
(docs/formats.md "Qwen3-VL and Qwen3-VL-MoE in Megatron checkpoints"): the text GPT under ``language_model.``, the
tower under ``vision_model.`` with its DeepStack mergers.

* HF (as transformers 5.24 saves it) -> Megatron legacy / torch_dist -> HF bitwise at TP / PP / EP layouts (tower,
  DeepStack mergers, ``pos_embed``, experts, grouped-GEMM experts), a torch_dist -> legacy reshard too; the tower's
  placement checked against orders re-derived here (megatron-core's per-head ``linear_qkv``, a row-parallel
  ``linear_fc2``'s column band, the stacked DeepStack tensor read with torch's own ``dcp.load``); a Megatron source
  read by the copy path gives the torch path's files byte for byte.
* Real Megatron-Bridge 0.6.2 (tests/bridge_qwen3_vl_oracle.py, one subprocess for the module): its own import of the
  HF directories, saved with ``save_megatron_model``, converts to transformers' tensors bitwise on both paths; our
  ``--to megatron-dist`` output has its keys and shapes and loads strictly (``dist_checkpointing.load``,
  RAISE_ALL) with every weight bitwise what it imports; our ``--to megatron-bridge`` output (dense TP2, MoE PP2)
  loads with its own loader (the provider our run_config.yaml names) strictly and bitwise, the provider's fields
  equal those Bridge derives from HF, keys and run_config.yaml fields equal its own save's.
* Refused in one line, nothing written: a config whose DeepStack mergers or tower tensors disagree with the
  checkpoint, ``attention_bias`` (an o_proj bias Megatron cannot hold), dense MLP layers for ``--to
  megatron-bridge`` (Bridge builds every layer sparse), a TP that does not divide the vision heads.
"""

from __future__ import annotations

import copy
import glob
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from converters.engine import convert
from tests.cases import save_randomized
from tests.test_convert_qwen3_vl import _refused
from tests.test_copy_path_vllm import assert_same_files
from tests.test_copy_targets import _torch_path
from tests.workers_qwen3_vl import QWEN3_VL_CASES
from tests.workers_qwen3_vl_moe import QWEN3_VL_MOE_CASES


def _case(name: str) -> tuple[str, dict]:
    """(model_type, config kwargs): ``vl`` Qwen3-VL untied (3 layers, tower depth 3, DeepStack [0, 2]); ``moe``
    Qwen3-VL-MoE tied, every layer sparse (tower depth 2, DeepStack [1, 0]: merger 0 on block 1); ``moe_dense`` with
    a dense layer 1 between sparse ones; ``biased`` Qwen3-VL with ``attention_bias``."""
    if name in ("vl", "biased"):
        return "qwen3_vl", copy.deepcopy(QWEN3_VL_CASES["q3_untied" if name == "vl" else "q3_tied"])
    kwargs = copy.deepcopy(QWEN3_VL_MOE_CASES["m_tied" if name == "moe" else "m_untied"])
    kwargs["text_config"]["attention_bias"] = False
    return "qwen3_vl_moe", kwargs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (HF directory saved by transformers, its tensors)."""
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    root = tmp_path_factory.mktemp("q3vl_megatron")
    out = {}
    for seed, name in enumerate(("vl", "moe", "moe_dense", "biased")):
        kind, kwargs = _case(name)
        cls, config = ((Qwen3VLForConditionalGeneration, Qwen3VLConfig) if kind == "qwen3_vl" else
                       (Qwen3VLMoeForConditionalGeneration, Qwen3VLMoeConfig))
        torch.manual_seed(seed)
        path = save_randomized(cls(config(**kwargs)), root / name)
        out[name] = (path, _tensors(path))
    return out


def _tensors(directory) -> dict:
    out = {}
    for f in sorted(glob.glob(f"{directory}/*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_bitwise(directory, source: dict) -> None:
    back = _tensors(directory)
    assert back.keys() == source.keys(), sorted(set(back) ^ set(source))[:6]
    assert [n for n in source if not (back[n].dtype == source[n].dtype and torch.equal(back[n], source[n]))] == []


def _per_head(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """megatron-core's ``linear_qkv`` with one query group per head: rows [q_h; k_h; v_h] for h in order."""
    q, k, v = qkv.chunk(3, dim=0)
    return torch.cat([torch.cat([q.chunk(heads)[h], k.chunk(heads)[h], v.chunk(heads)[h]]) for h in range(heads)])


def _legacy_state(root, name: str) -> dict:
    (it,) = glob.glob(f"{root}/iter_*") + glob.glob(f"{root}/release")
    return torch.load(f"{it}/{name}/model_optim_rng.pt", weights_only=False)["model"]


def _megatron_to_hf_both_paths(src, out: Path, **kw) -> Path:
    """``src`` -> HF by the copy path and by the torch path: the same files byte for byte; returns the copy path's."""
    convert(src, out / "copy", to="hf", workers=2, **kw)
    _torch_path(src, out / "torch", to="hf", workers=1, **kw)
    assert_same_files(out / "torch", out / "copy")
    return out / "copy"


# (name, --to, layout, legacy rank folder holding stage 0's TP rank 1): every layout of the module
LEGACY = [("vl", {"tp": 2, "pp": 3}, "mp_rank_01_000"),
          ("moe", {"tp": 2, "pp": 2, "ep": 2}, "mp_rank_01_000_000"),
          ("moe_dense", {"tp": 1, "ep": 4, "moe_grouped_gemm": True}, "mp_rank_00_003")]


@pytest.mark.parametrize("name,layout,rank1", LEGACY, ids=[c[0] for c in LEGACY])
def test_legacy_round_trip(tmp_path, checkpoints, name, layout, rank1):
    """HF -> legacy -> HF bitwise (config.json too), on both read paths; the tower on the first stage only,
    TP rank 1's shards as megatron-core splits them: ``linear_qkv`` rows per head, a row-parallel linear's column
    band, a DeepStack merger's ``linear_fc1`` rows, its norm whole."""
    path, source = checkpoints[name]
    convert(path, tmp_path / "m", to="megatron", workers=2, **layout)
    tp = layout["tp"]
    state = _legacy_state(tmp_path / "m", rank1)
    config = json.loads(Path(f"{path}/config.json").read_text())
    heads = config["vision_config"]["num_heads"]
    r = 1 if tp > 1 else 0
    qkv = _per_head(source["model.visual.blocks.1.attn.qkv.weight"], heads)
    assert torch.equal(state["vision_model.decoder.layers.1.self_attention.linear_qkv.weight"], qkv.chunk(tp)[r])
    assert torch.equal(state["vision_model.decoder.layers.0.mlp.linear_fc2.weight"],
                       source["model.visual.blocks.0.mlp.linear_fc2.weight"].chunk(tp, dim=1)[r])
    assert torch.equal(state["vision_model.decoder.deepstack_merger_list.1.linear_fc1.weight"],
                       source["model.visual.deepstack_merger_list.1.linear_fc1.weight"].chunk(tp)[r])
    assert torch.equal(state["vision_model.decoder.deepstack_merger_list.0.patch_norm.bias"],
                       source["model.visual.deepstack_merger_list.0.norm.bias"])
    assert torch.equal(state["vision_model.pos_embed.weight"], source["model.visual.pos_embed.weight"])
    assert "vision_model.decoder.deepstack_merger_list.0.linear_fc1._extra_state" in state
    assert "language_model.embedding.word_embeddings.weight" in state
    if layout.get("pp", 1) > 1:
        last = _legacy_state(tmp_path / "m", rank1.replace("_000", f"_{layout['pp'] - 1:03d}", 1))
        assert not any(k.startswith("vision_model.") for k in last)
    back = _megatron_to_hf_both_paths(tmp_path / "m", tmp_path / "back")
    _assert_bitwise(back, source)
    assert (back / "config.json").read_bytes() == Path(f"{path}/config.json").read_bytes()


@pytest.mark.parametrize("name,layout", [("vl", {"tp": 2}), ("moe", {"tp": 2, "pp": 2, "vpp": 2, "ep": 2}),
                                         ("moe_dense", {})])
def test_dist_round_trip_and_reshard(tmp_path, checkpoints, name, layout):
    """HF -> torch_dist -> HF bitwise (both read paths): the tower's blocks and DeepStack mergers stacked, merger
    k at index k (read with torch's own ``dcp.load``), the text layers stacked (per layer with a dense layer
    between sparse ones); torch_dist -> legacy TP2 -> HF bitwise, also from the args alone (no hf_config/)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    path, source = checkpoints[name]
    convert(path, tmp_path / "d", to="megatron-dist", workers=2, **layout)
    (it,) = glob.glob(f"{tmp_path}/d/release")
    meta = FileSystemReader(it).read_metadata().state_dict_metadata
    config = json.loads(Path(f"{path}/config.json").read_text())
    vis = config["vision_config"]
    n, depth, merged = len(vis["deepstack_visual_indexes"]), vis["depth"], 4 * vis["hidden_size"]
    key = "vision_model.decoder.deepstack_merger_list.linear_fc1.weight"
    assert tuple(meta[key].size) == (n, merged, merged)
    assert tuple(meta["vision_model.decoder.layers.self_attention.linear_qkv.weight"].size)[0] == depth
    assert f"vision_model.decoder.deepstack_merger_list.patch_norm._extra_state/shard_1_{n}" in meta
    stacked_text = "language_model.decoder.layers.self_attention.linear_qkv.weight" in meta
    assert stacked_text == (name != "moe_dense"), name
    got = {key: torch.empty(tuple(meta[key].size))}
    dcp_load(got, storage_reader=FileSystemReader(it), no_dist=True)
    for k in range(n):
        assert torch.equal(got[key][k], source[f"model.visual.deepstack_merger_list.{k}.linear_fc1.weight"])
    _assert_bitwise(_megatron_to_hf_both_paths(tmp_path / "d", tmp_path / "back"), source)
    convert(tmp_path / "d", tmp_path / "l", to="megatron", tp=2, workers=2)
    shutil.rmtree(tmp_path / "l" / "hf_config")  # the args alone describe it
    convert(tmp_path / "l", tmp_path / "back2", to="hf", workers=2)
    _assert_bitwise(tmp_path / "back2", source)
    back_config = json.loads((tmp_path / "back2" / "config.json").read_text())
    assert back_config["model_type"] == config["model_type"] and back_config["vision_config"] == vis
    assert back_config["text_config"]["rope_parameters"] == config["text_config"]["rope_parameters"]


# ------------------------------------------------------------------------------------------ real Bridge

# --to megatron-bridge layouts checked against Bridge: the dense model TP2, the MoE model PP2
BRIDGE_LAYOUTS = {"vl": {"tp": 2}, "moe": {"pp": 2}}
PROVIDERS = {"vl": "megatron.bridge.models.qwen_vl.qwen3_vl_provider.Qwen3VLModelProvider",
             "moe": "megatron.bridge.models.qwen_vl.qwen3_vl_provider.Qwen3VLMoEModelProvider"}
# run_config.yaml fields recording the parallel layout (ours: the one converted to) or set otherwise by the
# oracle's CPU run in Bridge's own file (bridge_gdn_oracle._cpu)
RUNTIME_FIELDS = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "moe_token_dispatcher_type",
                  "moe_permute_fusion", "bias_activation_fusion", "bias_dropout_fusion", "persist_layer_norm",
                  "masked_softmax_fusion", "gradient_accumulation_fusion", "apply_rope_fusion",
                  "cross_entropy_loss_fusion", "moe_router_fusion", "fused_residual_rmsnorm", "sequence_parallel"}


@pytest.fixture(scope="module")
def bridge(tmp_path_factory, checkpoints):
    """One run of real Megatron-Bridge 0.6.2 for the module: its own checkpoints of ``vl`` and ``moe``; our
    --to megatron-dist outputs (TP 1) loaded into the Qwen3VLModel it builds with megatron-core's strict
    ``dist_checkpointing.load``; our --to megatron-bridge outputs loaded with its own loader."""
    from tests.bridge_run import run_bridge_oracle

    root = tmp_path_factory.mktemp("q3vl_bridge")
    jobs = [{"op": "write", "hf": checkpoints[name][0], "out": str(root / f"real_{name}"), "mtp": False}
            for name in BRIDGE_LAYOUTS]
    for name in BRIDGE_LAYOUTS:
        convert(checkpoints[name][0], root / f"dist_{name}", to="megatron-dist", workers=2)
        jobs.append({"op": "load", "ckpt": str(root / f"dist_{name}" / "release"), "hf": checkpoints[name][0],
                     "mtp": False, "via": "dist_checkpointing"})
    ours = {name: convert(checkpoints[name][0], root / f"mb_{name}", to="megatron-bridge", workers=2, **layout)
            for name, layout in BRIDGE_LAYOUTS.items()}
    jobs += [{"op": "load", "ckpt": str(ours[name]), "hf": checkpoints[name][0], "mtp": False} for name in ours]
    real_vl, real_moe, dist_vl, dist_moe, mb_vl, mb_moe = run_bridge_oracle("bridge_qwen3_vl_oracle.py", jobs, root,
                                                                           timeout=600)
    return {"root": root, "real": {"vl": real_vl, "moe": real_moe}, "dist": {"vl": dist_vl, "moe": dist_moe},
            "bridge": {"vl": mb_vl, "moe": mb_moe}, "ours": ours}


def _keys(it_dir) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(it_dir)).read_metadata().state_dict_metadata
    return {k: list(v.size) if hasattr(v, "size") else "object" for k, v in meta.items()}


@pytest.mark.parametrize("name", list(BRIDGE_LAYOUTS))
def test_bridge_checkpoint_to_hf(bridge, checkpoints, tmp_path, name):
    """Bridge's own import of the HF directory, saved by ``save_megatron_model`` (tower blocks and DeepStack
    mergers stacked, text layers stacked, experts [L, E, ...]) -> pmz -> HF: transformers' tensors bitwise, the
    copy path's files the torch path's."""
    path, source = checkpoints[name]
    keys = bridge["real"][name]["keys"]
    assert "vision_model.decoder.deepstack_merger_list.linear_fc2.weight" in keys
    back = _megatron_to_hf_both_paths(bridge["real"][name]["out"], tmp_path, hf_config=path)
    _assert_bitwise(back, source)


@pytest.mark.parametrize("name", list(BRIDGE_LAYOUTS))
def test_our_dist_output_is_bridges(bridge, name):
    """Our --to megatron-dist output holds exactly Bridge's keys, global shapes (vocabulary rows aside: pmz pads
    them as Megatron-LM does) and ``_extra_state`` items (but its common state), and megatron-core's strict
    ``dist_checkpointing.load`` puts every weight Bridge imports from HF into its model, bitwise."""
    load = bridge["dist"][name]
    assert load["compared"] > 80 and (load["mismatched"], load["missing"], load["unexpected"]) == ([], [], []), load
    vocab = ("language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight")
    ours = {k: v[-1:] if k in vocab else v for k, v in _keys(bridge["root"] / f"dist_{name}" / "release").items()}
    theirs = {k: v[-1:] if k in vocab else v for k, v in bridge["real"][name]["keys"].items()
              if not k.startswith("common_state")}
    assert ours == theirs


@pytest.mark.parametrize("name", list(BRIDGE_LAYOUTS))
def test_megatron_bridge_output_loads_in_bridge(bridge, checkpoints, tmp_path, name):
    """Our --to megatron-bridge output: Bridge's own loader instantiates the provider our run_config.yaml names
    with the public fields its bridge derives from HF (``hf_text_config`` and ``vision_config`` included) and loads
    it strictly, every tensor bitwise what it imports; keys, shapes, ``_extra_state`` items and every run_config
    ``model`` field equal its own save's (but the parallel layout and the oracle's CPU switches); back to HF bitwise
    with config.json."""
    import yaml

    load = bridge["bridge"][name]
    assert load["loader"] == PROVIDERS[name], load
    assert load["compared"] > 80 and (load["mismatched"], load["missing"], load["unexpected"]) == ([], [], []), load
    assert set(load["config_diff"]) <= {"hf_model_id"}, load["config_diff"]
    (it,) = glob.glob(f"{bridge['ours'][name]}/iter_*")
    theirs = {k: v for k, v in bridge["real"][name]["keys"].items() if not k.startswith("common_state")}
    assert _keys(it) == theirs
    mine = yaml.safe_load(open(f"{it}/run_config.yaml"))["model"]
    real = yaml.safe_load(bridge["real"][name]["run_config"])["model"]
    assert mine["_target_"] == real["_target_"] == PROVIDERS[name]
    for nested in ("vision_config", "hf_text_config"):
        ours_nested = mine.pop(nested)
        assert {k: (v, real[nested].get(k)) for k, v in ours_nested.items() if real[nested].get(k) != v} == {}, nested
    differ = {k: (v, real.get(k, "absent")) for k, v in mine.items() if k not in RUNTIME_FIELDS and real.get(k) != v}
    assert not differ, differ
    layout = BRIDGE_LAYOUTS[name]
    assert (mine["tensor_model_parallel_size"], mine["pipeline_model_parallel_size"]) == \
        (layout.get("tp", 1), layout.get("pp", 1))
    path, source = checkpoints[name]
    out = convert(bridge["ours"][name], tmp_path / "hf", to="hf", workers=2)
    _assert_bitwise(out, source)
    assert (out / "config.json").read_bytes() == Path(f"{path}/config.json").read_bytes()


# ------------------------------------------------------------------------------------------ bad input


def _with_config(src, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config_path = next(Path(dst).rglob("config.json"))
    config = json.loads(config_path.read_text())
    edit(config)
    config_path.write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("copy_path", ["1", "0"])
def test_bad_input_refused_in_one_line(checkpoints, tmp_path, capsys, monkeypatch, copy_path):
    monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
    vl = checkpoints["vl"][0]
    convert(vl, tmp_path / "d", to="megatron-dist", workers=2)
    # a config with one DeepStack merger fewer than the checkpoint stacks
    fewer = _with_config(tmp_path / "d", tmp_path / "fewer",
                         lambda c: c["vision_config"].update(deepstack_visual_indexes=[0]))
    err = _refused([str(fewer), "--to", "hf"], tmp_path / "o1", capsys)
    assert ("vision_config.deepstack_visual_indexes=[0] implies 1 stacked, but" in err
            and "vision_model.decoder.deepstack_merger_list.linear_fc1.weight of shape (2, 256, 256)" in err), err
    # a DeepStack index beyond the tower's depth
    beyond = _with_config(tmp_path / "d", tmp_path / "beyond",
                          lambda c: c["vision_config"].update(deepstack_visual_indexes=[0, 3]))
    err = _refused([str(beyond), "--to", "hf"], tmp_path / "o2", capsys)
    assert "deepstack_visual_indexes=[0, 2, 3]" not in err and "names block(s) [3] but the tower has depth=3" in err
    # a tower tensor of another shape than the config implies (a 5x5 learned position grid for the 4x4 stored)
    grid = _with_config(tmp_path / "d", tmp_path / "grid",
                        lambda c: c["vision_config"].update(num_position_embeddings=25))
    err = _refused([str(grid), "--to", "megatron", "--tp", "2"], tmp_path / "o3", capsys)
    assert "tensor vision_model.pos_embed.weight has global shape (16, 64), the config implies (25, 64)" in err, err
    # an o_proj bias Megatron cannot hold; dense layers Bridge would build sparse; TP not dividing the vision heads
    for to in ("megatron", "megatron-dist", "megatron-bridge"):
        err = _refused([checkpoints["biased"][0], "--to", to], tmp_path / f"b-{to}", capsys)
        assert "o_proj" in err and "bias" in err, err
    err = _refused([checkpoints["moe_dense"][0], "--to", "megatron-bridge"], tmp_path / "o4", capsys)
    assert "makes every layer sparse; this model has a dense MLP in layer(s) 1" in err, err
    one = _with_config(vl, tmp_path / "one_head", lambda c: c["vision_config"].update(num_heads=1))
    for to in ("megatron", "megatron-dist", "megatron-bridge"):
        err = _refused([str(one), "--to", to, "--tp", "2"], tmp_path / f"h-{to}", capsys)
        assert "--tp 2 does not divide the vision tower's num_heads=1" in err, err


# ------------------------------------------------------------------------------------------ copy path

COPY_CASES = [("vl", "megatron", {"tp": 2, "pp": 3}), ("vl", "megatron-dist", {"tp": 2}),
              ("moe", "megatron", {"tp": 2, "ep": 2}), ("moe", "megatron-dist", {"ep": 2}),
              ("moe_dense", "megatron", {"ep": 2, "moe_grouped_gemm": True}), ("moe_dense", "megatron-dist", {})]


@pytest.mark.parametrize("name,to,layout", COPY_CASES, ids=[f"{n}-{t}" for n, t, _ in COPY_CASES])
def test_copy_path_writes_what_the_torch_path_writes(checkpoints, tmp_path, paths_taken, name, to, layout):
    """HF -> Megatron on the copy path: the torch path's checkpoint tensor for tensor (rank files' keys, order and
    tensors; torch_dist's metadata, common state and tensors), the tower's stacks and _extra_state items included;
    and a Megatron -> Megatron reshard of it likewise."""
    from tests.test_copy_path_hybrid import _same_output

    path = checkpoints[name][0]
    _torch_path(path, tmp_path / "slow", to=to, workers=1, **layout)
    convert(path, tmp_path / "fast", to=to, workers=2, **layout)
    assert paths_taken[-1] is True, "the copy path was not taken"
    _same_output(tmp_path / "slow", tmp_path / "fast")
    other = "megatron" if to == "megatron-dist" else "megatron-dist"
    _torch_path(tmp_path / "fast", tmp_path / "slow2", to=other, tp=1, workers=1)
    convert(tmp_path / "fast", tmp_path / "fast2", to=other, tp=1, workers=2)
    assert paths_taken[-1] is True, "the copy path was not taken"
    _same_output(tmp_path / "slow2", tmp_path / "fast2")
