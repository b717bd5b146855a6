"""Qwen2-VL and Qwen2.5-VL in Megatron-Bridge's checkpoint layout, both directions, against real
Megatron-Bridge.

The reference is Megatron-Bridge 0.6.2 itself (``tests/bridge_oracle.py`` under ``.venv-bridge``, one
subprocess for the whole module): it builds each Qwen2.5-VL model from the HF directory with its own
mapping and writes its checkpoint (``save_megatron_model``), which ``pmz`` must turn back into the
original HF tensors bitwise (copy path and torch path); and it loads what ``pmz convert --to
megatron-bridge`` wrote with its own loader (run_config.yaml, strict dist_checkpointing load), whose
state dict must equal, bitwise, the model it builds from the HF weights. Megatron-Bridge has no Qwen2-VL
bridge: our Qwen2-VL layout is checked against the same real checkpoint (its ``language_model.*`` tensors
for the same text config) and against the HF file's own ``visual.*`` names, and round-trips bitwise.
Damaged checkpoints fail in one line naming the file, tensor and numbers, with nothing written.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from converters.cli import main
from converters.engine import convert
from tests.bridge_run import run_bridge_oracle
from tests.vl_cases import write_vl_model

QWEN25 = ("v25_untied", "v25_tied")  # Megatron-Bridge has a bridge for these
QWEN2 = ("untied", "tied")  # and none for Qwen2-VL (our extrapolation of the same layout)


def _hf_tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _metadata(ckpt: Path):
    it_dir = next(p for p in sorted(ckpt.iterdir()) if p.name.startswith("iter_"))
    return it_dir, pickle.loads((it_dir / ".metadata").read_bytes())


def _tensor_shapes(ckpt: Path) -> dict[str, tuple]:
    _, md = _metadata(ckpt)
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}


@pytest.fixture(scope="module")
def bridge(tmp_path_factory):
    """HF directories of the four tiny VL models, our Bridge checkpoints of them, and one run of real
    Megatron-Bridge: its checkpoints of the Qwen2.5-VL models and its strict load of ours."""
    root = tmp_path_factory.mktemp("bridge_vl")
    hf = {case: Path(write_vl_model(root / "hf", case, seed=i)) for i, case in enumerate(QWEN25 + QWEN2)}
    ours = {}
    for case, layout in zip(QWEN25 + QWEN2, ({"tp": 2, "pp": 2}, {}, {"tp": 2}, {"pp": 3})):
        ours[case] = convert(hf[case], root / "ours" / case, to="megatron-bridge", **layout)
    real = {case: root / "real" / case for case in QWEN25}
    jobs = [{"op": "write", "hf": str(hf[c]), "out": str(real[c])} for c in QWEN25]
    jobs += [{"op": "load", "ckpt": str(ours[c]), "hf": str(hf[c])} for c in QWEN25]
    results = run_bridge_oracle("bridge_oracle.py", jobs, root)
    loads = dict(zip(QWEN25, results[len(QWEN25):]))
    return {"root": root, "hf": hf, "ours": ours, "real": real, "loads": loads}


@pytest.mark.parametrize("copy_path", ["1", "0"], ids=["copy-path", "torch-path"])
@pytest.mark.parametrize("case", QWEN25)
def test_real_bridge_checkpoint_to_hf_is_bitwise(bridge, tmp_path, monkeypatch, case, copy_path):
    """What Megatron-Bridge wrote (text under language_model., layer-stacked; the tower under HF names)
    converts to the HF tensors it was built from, bitwise, on both conversion paths."""
    monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
    out = convert(bridge["real"][case], tmp_path / "hf", to="hf")
    got, want = _hf_tensors(out), _hf_tensors(bridge["hf"][case])
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2_5_vl"


@pytest.mark.parametrize("case", QWEN25)
def test_real_bridge_loads_what_pmz_writes(bridge, case):
    """Megatron-Bridge's own loader takes our checkpoint strictly (every tensor, no extra) and its model
    equals, bitwise, the one it builds from the HF weights."""
    load = bridge["loads"][case]
    assert load["provider"].endswith("qwen25_vl_provider.Qwen25VLModelProvider"), load
    assert load["compared"] > 40 and not load["mismatched"] and not load["missing"] and not load["unexpected"], load


@pytest.mark.parametrize("case", QWEN25)
def test_pmz_writes_the_tensors_bridge_writes(bridge, case):
    """Same torch_dist keys, global shapes and dtypes as Megatron-Bridge's own checkpoint of the model,
    and the same empty _extra_state items (only the common-state item differs: we write common.pt)."""
    assert _tensor_shapes(bridge["ours"][case]) == _tensor_shapes(bridge["real"][case])
    objects = [{k for k, v in _metadata(bridge[w][case])[1].state_dict_metadata.items() if not hasattr(v, "chunks")}
               for w in ("ours", "real")]
    assert objects[0] == objects[1] - {"common_state/shard_0_1"}


def test_qwen2_vl_layout_is_bridge_text_plus_hf_vision(bridge):
    """Qwen2-VL (no Bridge bridge): its language_model.* tensors are what Bridge writes for the same text
    config (the v25_untied case shares untied's), its visual.* tensors the HF file's names and shapes."""
    ours = _tensor_shapes(bridge["ours"]["untied"])
    real = _tensor_shapes(bridge["real"]["v25_untied"])
    assert {k: s for k, s in ours.items() if k.startswith("language_model.")} == \
        {k: s for k, s in real.items() if k.startswith("language_model.")}
    hf = _hf_tensors(bridge["hf"]["untied"])
    assert {k: s for k, s in ours.items() if not k.startswith("language_model.")} == \
        {k: tuple(t.shape) for k, t in hf.items() if k.startswith("visual.")}


@pytest.mark.parametrize("case", QWEN25 + QWEN2)
def test_hf_bridge_hf_round_trip_is_bitwise(bridge, tmp_path, case):
    """HF -> --to megatron-bridge (at the TP/PP the fixture recorded) -> HF: the original tensors and
    config.json; run_config.yaml is YAML data naming the provider (none for Qwen2-VL)."""
    import yaml

    out = convert(bridge["ours"][case], tmp_path / "hf", to="hf")
    got, want = _hf_tensors(out), _hf_tensors(bridge["hf"][case])
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert (out / "config.json").read_bytes() == (bridge["hf"][case] / "config.json").read_bytes()
    it_dir, _ = _metadata(bridge["ours"][case])
    model = yaml.safe_load((it_dir / "run_config.yaml").read_text())["model"]
    hf_config = json.loads((bridge["hf"][case] / "config.json").read_text())
    assert model["num_layers"] == hf_config["text_config"]["num_hidden_layers"]
    assert model["vision_config"]["depth"] == hf_config["vision_config"]["depth"]
    assert model.get("_target_", "").endswith("Qwen25VLModelProvider") == (case in QWEN25)


# ---------------------------------------------------------------------------------------------- bad input


def _damaged(bridge, tmp_path, case: str, edit) -> Path:
    """A copy of the real Bridge checkpoint of ``case`` whose .metadata ``edit`` changed."""
    ckpt = tmp_path / "bad"
    shutil.copytree(bridge["real"][case], ckpt)
    it_dir, md = _metadata(ckpt)
    edit(md)
    (it_dir / ".metadata").write_bytes(pickle.dumps(md))
    return ckpt


def _pmz_fails(capsys, tmp_path, *args) -> str:
    rc = main(["convert", *map(str, args), str(tmp_path / "out"), "--to", "hf", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert not (tmp_path / "out").exists()
    return err[0]


def test_vision_tensor_of_the_wrong_shape(bridge, tmp_path, capsys):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def edit(md):
        meta = md.state_dict_metadata["visual.blocks.1.attn.qkv.weight"]
        meta.size = torch.Size([96, 64])
        meta.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([96, 64]))]

    line = _pmz_fails(capsys, tmp_path, _damaged(bridge, tmp_path, "v25_untied", edit))
    assert "visual.blocks.1.attn.qkv.weight of shape (192, 64)" in line and "has (96, 64)" in line, line
    assert "config.json: vision_config (hidden_size=64, num_heads=4" in line and ".metadata" in line, line


def test_missing_visual_block(bridge, tmp_path, capsys):
    def edit(md):
        for key in [k for k in md.state_dict_metadata if k.startswith("visual.blocks.1.")]:
            del md.state_dict_metadata[key]

    line = _pmz_fails(capsys, tmp_path, _damaged(bridge, tmp_path, "v25_tied", edit))
    assert "vision_config.depth=2, but the weights hold 1 layer(s) (visual.blocks.0)" in line, line
    assert ".metadata" in line and "config.json" in line, line


def test_language_model_layer_count_disagrees_with_config(bridge, tmp_path, capsys):
    config = tmp_path / "config"
    shutil.copytree(bridge["hf"]["v25_untied"], config, ignore=shutil.ignore_patterns("*.safetensors"))
    data = json.loads((config / "config.json").read_text())
    data["text_config"]["num_hidden_layers"] = 3
    (config / "config.json").write_text(json.dumps(data))
    line = _pmz_fails(capsys, tmp_path, bridge["real"]["v25_untied"], "--hf-config", config)
    assert f"{config}/config.json does not describe the checkpoint" in line, line
    assert "num_hidden_layers=3, but language_model.decoder.layers.self_attention.linear_qkv.weight has shape " \
           "(2, 128, 64) (2 stacked layers)" in line, line


def test_megatron_lm_formats_point_at_the_bridge_target(bridge, tmp_path, capsys):
    rc = main(["convert", str(bridge["hf"]["untied"]), str(tmp_path / "out"), "--to", "megatron-dist", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "--to megatron-bridge" in err[0], err
    assert not (tmp_path / "out").exists()


def test_mbridge_vision_layout_is_named(bridge, tmp_path, capsys):
    """mbridge stores the tower as megatron-core blocks (vision_model.*): refused by name, not as a
    pile of missing visual.* tensors."""
    import dataclasses

    def renamed(key: str) -> str:
        return "vision_model." + key[len("visual."):] if key.startswith("visual.") else key

    def edit(md):
        md.state_dict_metadata = {renamed(k): v for k, v in md.state_dict_metadata.items()}
        md.storage_data = {dataclasses.replace(i, fqn=renamed(i.fqn)): v for i, v in md.storage_data.items()}

    line = _pmz_fails(capsys, tmp_path, _damaged(bridge, tmp_path, "v25_untied", edit))
    assert "vision_model.* (mbridge's layout" in line and ".metadata" in line, line
