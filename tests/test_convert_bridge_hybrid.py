"""``pmz convert --to megatron-bridge`` for the Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next; text
checkpoints, MTP block included), against real Megatron-Bridge 0.6.2.

The reference is Megatron-Bridge itself (``tests/bridge_gdn_oracle.py`` under ``.venv-bridge``, one subprocess for
the module; its CPU stand-ins for Transformer Engine and FLA are checked by tests/test_bridge_gdn_oracle.py): for
each model it writes its own checkpoint from the HF directory (``save_megatron_model``) and loads ours with its
own loader (``load_model_config`` on our run_config.yaml, ``build_and_load_model``). Ours must load strictly
into the model Bridge imports from the same HF weights, bitwise; the provider our run_config.yaml makes must
have the public fields Bridge's own bridge derives from the HF config; our torch_dist keys, global shapes and
``_extra_state`` items must be those of Bridge's own checkpoint; and pmz must read what it wrote back to the HF
tensors bitwise. Models Bridge's bridges build otherwise are refused in one line with nothing written.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from converters.cli import main
from converters.engine import convert
from tests.bridge_run import run_bridge_oracle
from tests.test_bridge_gdn_oracle import _add_mtp, _configs
from tests.test_convert_bridge_vl import _hf_tensors, _metadata, _tensor_shapes

CASES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
LOADED = (*CASES, "qwen3_5_no_mtp")  # a checkpoint without MTP: written and loaded without one
LAYOUTS = {"qwen3_5": {"pp": 2}, "qwen3_5_moe": {}, "qwen3_next": {"tp": 2}, "qwen3_5_no_mtp": {"tp": 2}}
GPT_PROVIDER = "megatron.bridge.models.gpt_provider.GPTModelProvider"
# provider fields Bridge derives from the HF directory itself (its path), not from the model
CONFIG_FIELDS_NOT_WRITTEN = {"hf_model_id"}
# run_config.yaml fields the oracle's CPU run sets otherwise in Bridge's own file (bridge_gdn_oracle._cpu) or that
# record the parallel layout (ours: the TP/PP converted to)
RUNTIME_FIELDS = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                  "moe_token_dispatcher_type", "moe_permute_fusion", "hf_model_id"}


@pytest.fixture(scope="module")
def bridge(tmp_path_factory):
    """Tiny HF checkpoints of the three hybrids with an MTP block (and Qwen3.5 without), our --to megatron-bridge
    checkpoints of them (Qwen3.5 PP2, Qwen3.5-MoE plain, Qwen3-Next TP2, Qwen3.5 without MTP TP2), and one
    oracle run: Bridge writes its own checkpoint of each model with MTP and loads all of ours."""
    from tests.workers_qwen3_5 import write_model

    root = tmp_path_factory.mktemp("bridge_hybrid")
    hf, ours = {}, {}
    for i, (case, config) in enumerate(_configs().items()):
        config.vocab_size = 102  # Bridge builds the vocabulary unpadded: it must divide by the TP2 layouts' tp
        hf[case] = Path(write_model(root / "hf", case, config, seed=20 + i))
        if case == "qwen3_5":
            hf["qwen3_5_no_mtp"] = Path(shutil.copytree(hf[case], root / "hf" / "qwen3_5_no_mtp"))
        _add_mtp(hf[case], seed=120 + i)
    ours = {c: convert(hf[c], root / "ours" / c, to="megatron-bridge", workers=1, **LAYOUTS[c]) for c in LOADED}
    real = {case: root / "real" / case for case in CASES}
    jobs = [{"op": "write", "hf": str(hf[c]), "out": str(real[c])} for c in CASES]
    jobs += [{"op": "load", "hf": str(hf[c]), "ckpt": str(ours[c])} for c in LOADED]
    results = run_bridge_oracle("bridge_gdn_oracle.py", jobs, root)
    return {"hf": hf, "ours": ours, "real": real, "writes": dict(zip(CASES, results[:3])),
            "loads": dict(zip(LOADED, results[3:]))}


def _run_config(ckpt: Path) -> dict:
    import yaml

    it_dir, _ = _metadata(ckpt)
    return yaml.safe_load((it_dir / "run_config.yaml").read_text())


@pytest.mark.parametrize("case", LOADED)
def test_real_bridge_loads_what_pmz_writes(bridge, case):
    """Bridge's own loader takes our checkpoint strictly (every tensor, MTP included, none left over), its
    provider is GPTModelProvider with the public fields Bridge's bridge derives from the HF config, and its
    model equals, bitwise, the one Bridge imports from the HF weights."""
    load = bridge["loads"][case]
    assert load["loader"] == GPT_PROVIDER, load
    assert any(k.startswith("mtp.") for k in _tensor_shapes(bridge["ours"][case])) == (case != "qwen3_5_no_mtp")
    assert load["compared"] >= 40 and not (load["mismatched"] or load["missing"] or load["unexpected"]), load
    assert set(load["config_diff"]) <= CONFIG_FIELDS_NOT_WRITTEN, load["config_diff"]


@pytest.mark.parametrize("case", CASES)
def test_pmz_writes_the_tensors_bridge_writes(bridge, case):
    """Same torch_dist keys, global shapes and dtypes as Bridge's own checkpoint (per-layer keys, the split
    in_proj/conv1d components, MTP under mtp.layers.0), and the same empty ``_extra_state`` items (only the
    common-state item differs: we write common.pt)."""
    ours, real = bridge["ours"][case], bridge["real"][case]
    assert any(k.startswith("mtp.layers.0.") for k in _tensor_shapes(ours))
    assert _tensor_shapes(ours) == _tensor_shapes(real)
    assert _tensor_shapes(ours) == {k: tuple(v) for k, v in bridge["writes"][case]["keys"].items() if v != "object"}
    mds = [_metadata(path)[1].state_dict_metadata for path in (ours, real)]
    assert {k: v.properties.dtype for k, v in mds[0].items() if hasattr(v, "chunks")} == \
        {k: v.properties.dtype for k, v in mds[1].items() if hasattr(v, "chunks")}
    objects = [{k for k, v in md.items() if not hasattr(v, "chunks")} for md in mds]
    assert objects[0] == objects[1] - {"common_state/shard_0_1"}


@pytest.mark.parametrize("case", CASES)
def test_run_config_fields_are_bridges(bridge, case):
    """Every field of our run_config.yaml's ``model`` equals the one in the run_config.yaml Bridge writes for the
    same HF directory (YAML as written: the layer pattern as a per-layer list, the block spec a function
    reference), but the parallel layout (ours: the one converted to) and the oracle's CPU switches."""
    import yaml

    ours = _run_config(bridge["ours"][case])["model"]
    real = yaml.safe_load(bridge["writes"][case]["run_config"])["model"]
    assert ours["_target_"] == real["_target_"] == GPT_PROVIDER
    differ = {k: (v, real.get(k, "absent")) for k, v in ours.items() if k not in RUNTIME_FIELDS and real.get(k) != v}
    assert not differ, differ
    layout = LAYOUTS[case]
    assert (ours["tensor_model_parallel_size"], ours["pipeline_model_parallel_size"]) == \
        (layout.get("tp", 1), layout.get("pp", 1))


@pytest.mark.parametrize("copy_path", ["1", "0"], ids=["copy-path", "torch-path"])
@pytest.mark.parametrize("case", LOADED)
def test_hf_bridge_hf_round_trip_is_bitwise(bridge, tmp_path, monkeypatch, case, copy_path):
    """HF -> --to megatron-bridge -> HF: the original tensors (``mtp.*`` included where there) and config.json,
    bitwise."""
    monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
    out = convert(bridge["ours"][case], tmp_path / "hf", to="hf", workers=1)
    got, want = _hf_tensors(out), _hf_tensors(bridge["hf"][case])
    assert any(k.startswith("mtp.") for k in want) == (case != "qwen3_5_no_mtp")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert (out / "config.json").read_bytes() == (bridge["hf"][case] / "config.json").read_bytes()


# ---------------------------------------------------------------------------------------------- refusals


def _refused(path: str, tmp_path, capsys) -> str:
    capsys.readouterr()
    rc = main(["convert", str(path), str(tmp_path / "out"), "--to", "megatron-bridge", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert not (tmp_path / "out").exists()
    return err[0]


def test_what_bridge_builds_otherwise_is_refused(tmp_path, capsys):
    """Bridge's Qwen3-Next bridge makes every layer MoE and renormalises the top-k weights; megatron-core builds
    the MTP layer from the last layer's spec (a linear-attention last layer cannot carry it): such models would
    load as other models, or not at all. One line each, nothing written."""
    from tests.test_convert_hybrid import FULL, LIN, add_mtp
    from tests.test_convert_hybrid import _configs as small
    from tests.workers_qwen3_5 import write_model

    configs = small()
    dense = write_model(tmp_path / "hf", "dense", configs["qwen3_next"], 1)  # mlp_only_layers=[1]
    line = _refused(dense, tmp_path, capsys)
    assert "makes every layer sparse" in line and "dense MLP in layer(s) 1" in line, line
    no_norm = copy.deepcopy(configs["qwen3_next"])
    no_norm.mlp_only_layers = []
    line = _refused(write_model(tmp_path / "hf", "no_norm", no_norm, 2), tmp_path, capsys)
    assert "renormalises the top-2 router weights" in line and "norm_topk_prob=False" in line, line
    last_linear = copy.deepcopy(configs["qwen3_5"])
    last_linear.layer_types = [FULL, LIN, LIN, LIN]
    path = write_model(tmp_path / "hf", "last_linear", last_linear, 3)
    add_mtp(path, 3)
    line = _refused(path, tmp_path, capsys)
    assert "MTP block and its last layer (3) is linear_attention" in line, line
    assert json.loads(Path(path, "config.json").read_text())["mtp_num_hidden_layers"] == 1

