"""The text models (Llama, Qwen2, Qwen3, Qwen3-MoE) in Megatron-Bridge's checkpoint layout and in
Megatron-LM's torch_dist, both directions, against real Megatron-Bridge 0.6.2.

The reference is Megatron-Bridge itself (``tests/bridge_oracle.py`` under ``.venv-bridge``, one subprocess
for the whole module, checkpoint keys as Bridge's default Transformer-Engine layer spec names them): it
builds Qwen3-MoE and Qwen3 from the HF directory with its own mapping and writes its checkpoint, which
``pmz convert --to hf`` must turn back into the HF tensors bitwise (copy path and torch path); Bridge's
MoE layers keep ``pre_mlp_layernorm.weight`` (TE fuses that norm into ``linear_fc1``, which a MoE layer
does not have). It loads, strictly, what ``pmz convert --to megatron-bridge`` wrote for each text model
(its own loader on our run_config.yaml, whose provider fields must be the ones Bridge derives from the HF
config) and what ``--to megatron-dist`` wrote (into the model it builds from the HF config, with the
layer spec the checkpoint's args name), and its weights must equal, bitwise, those it imports from HF.
Models Bridge 0.6.2 cannot build are refused in one line with nothing written.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from converters.cli import main
from converters.engine import convert
from tests.bridge_run import run_bridge_oracle
from tests.cases import write_hf_model
from tests.test_convert_bridge_vl import _hf_tensors, _metadata, _tensor_shapes

REAL = ("qwen3moe", "qwen3")  # Bridge writes these; all four are loaded back
BRIDGE_LAYOUTS = {"qwen3moe": {"tp": 2}, "qwen3": {"pp": 2}, "llama": {}, "qwen2": {"tp": 2, "pp": 2}}
DIST = ("qwen3moe", "qwen3")
# provider fields Bridge derives from the HF directory itself (its path), not from the model
CONFIG_FIELDS_NOT_WRITTEN = {"hf_model_id"}


def _configs() -> dict:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    return {
        # every layer sparse (Bridge's Qwen3-MoE bridge makes all layers MoE), renormalised top-2
        "qwen3moe": Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                   norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False),
        "qwen3": Qwen3Config(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                             tie_word_embeddings=True),
        # Llama 3.1 RoPE as megatron-core implements it (frequency factors 1 and 4 over 8192 positions)
        "llama": LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                             tie_word_embeddings=False, rope_parameters={
                                 "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        "qwen2": Qwen2Config(vocab_size=78, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=True, rms_norm_eps=1e-5),
    }


@pytest.fixture(scope="module")
def bridge(tmp_path_factory):
    """HF directories of the tiny text models, our Megatron-Bridge and torch_dist checkpoints of them, and
    one run of real Megatron-Bridge: its checkpoints of Qwen3-MoE and Qwen3, its strict loads of ours."""
    root = tmp_path_factory.mktemp("bridge_text")
    hf = {case: write_hf_model(root / "hf", case, cfg, seed=i) for i, (case, cfg) in enumerate(_configs().items())}
    ours, dist, errors = {}, {}, {}
    for case, layout in BRIDGE_LAYOUTS.items():
        try:
            ours[case] = convert(hf[case], root / "ours" / case, to="megatron-bridge", **layout)
        except Exception as exc:  # the current failure, reported by the tests that need this checkpoint
            errors[case] = f"{type(exc).__name__}: {exc}"
    for case in DIST:
        dist[case] = convert(hf[case], root / "dist" / case, to="megatron-dist")
    real = {case: root / "real" / case for case in REAL}
    jobs = [{"op": "write", "hf": str(hf[c]), "out": str(real[c])} for c in REAL]
    jobs += [{"op": "load", "ckpt": str(ours[c]), "hf": str(hf[c])} for c in ours]
    jobs += [{"op": "load", "ckpt": str(dist[c]), "hf": str(hf[c])} for c in DIST]
    results = iter(run_bridge_oracle("bridge_oracle.py", jobs, root))
    writes = {c: next(results) for c in REAL}
    loads = {c: next(results) for c in ours}
    dist_loads = {c: next(results) for c in DIST}
    return {"hf": hf, "ours": ours, "errors": errors, "dist": dist, "real": real, "writes": writes, "loads": loads,
            "dist_loads": dist_loads}


def _ours(bridge, case: str) -> Path:
    assert case not in bridge["errors"], bridge["errors"][case]
    return bridge["ours"][case]


def test_bridge_keeps_the_moe_pre_mlp_norm_unfused(bridge):
    """What the fixture's Bridge writes: dense layers' pre-MLP norm fused into linear_fc1 (TE's name), MoE
    layers' a module of its own (``pre_mlp_layernorm``), the input norm fused into linear_qkv in both."""
    moe, dense = bridge["writes"]["qwen3moe"]["keys"], bridge["writes"]["qwen3"]["keys"]
    assert moe["decoder.layers.pre_mlp_layernorm.weight"] == [2, 64] and not any("linear_fc1.layer_norm" in k
                                                                                  for k in moe), sorted(moe)
    assert dense["decoder.layers.mlp.linear_fc1.layer_norm_weight"] == [2, 32] and not any("pre_mlp" in k
                                                                                           for k in dense)
    assert all("decoder.layers.self_attention.linear_qkv.layer_norm_weight" in k for k in (moe, dense))


@pytest.mark.parametrize("copy_path", ["1", "0"], ids=["copy-path", "torch-path"])
@pytest.mark.parametrize("case", REAL)
def test_real_bridge_checkpoint_to_hf_is_bitwise(bridge, tmp_path, monkeypatch, case, copy_path):
    """What Megatron-Bridge wrote converts to the HF tensors it was built from, bitwise, on both paths."""
    monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
    out = convert(bridge["real"][case], tmp_path / "hf", to="hf")
    got, want = _hf_tensors(out), _hf_tensors(bridge["hf"][case])
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)


@pytest.mark.parametrize("case", list(BRIDGE_LAYOUTS))
def test_real_bridge_loads_what_pmz_writes(bridge, case):
    """Bridge's own loader takes our --to megatron-bridge checkpoint strictly (every tensor, no extra), its
    provider is Bridge's GPTModelProvider with the fields Bridge derives from the HF config, and its model
    equals, bitwise, the one it imports from the HF weights."""
    _ours(bridge, case)
    load = bridge["loads"][case]
    assert load["provider"] == "megatron.bridge.models.gpt_provider.GPTModelProvider", load
    assert load["compared"] > 10 and not load["mismatched"] and not load["missing"] and not load["unexpected"], load
    assert set(load["config_diff"]) <= CONFIG_FIELDS_NOT_WRITTEN, load["config_diff"]


@pytest.mark.parametrize("case", DIST)
def test_real_bridge_loads_what_pmz_writes_as_megatron_dist(bridge, case):
    """--to megatron-dist: Bridge builds the model from the HF config with the layer spec the checkpoint's
    args declare and loads the torch_dist folder with raise_all (no key missing on either side)."""
    load = bridge["dist_loads"][case]
    assert load["compared"] > 10 and not load["mismatched"] and not load["missing"] and not load["unexpected"], load


@pytest.mark.parametrize("case", REAL)
def test_pmz_writes_the_tensors_bridge_writes(bridge, case):
    """Same torch_dist keys, global shapes and dtypes as Bridge's own checkpoint of the model, and the same
    empty _extra_state items (only the common-state item differs: we write common.pt)."""
    assert _tensor_shapes(_ours(bridge, case)) == _tensor_shapes(bridge["real"][case])
    objects = [{k for k, v in _metadata(path)[1].state_dict_metadata.items() if not hasattr(v, "chunks")}
               for path in (bridge["ours"][case], bridge["real"][case])]
    assert objects[0] == objects[1] - {"common_state/shard_0_1"}


@pytest.mark.parametrize("case", list(BRIDGE_LAYOUTS))
def test_hf_bridge_hf_round_trip_is_bitwise(bridge, tmp_path, case):
    """HF -> --to megatron-bridge (at the TP/PP the fixture recorded) -> HF: the original tensors and
    config.json; run_config.yaml is YAML data naming the provider and the recorded layout."""
    import yaml

    out = convert(_ours(bridge, case), tmp_path / "hf", to="hf")
    got, want = _hf_tensors(out), _hf_tensors(bridge["hf"][case])
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert (out / "config.json").read_bytes() == (bridge["hf"][case] / "config.json").read_bytes()
    it_dir, _ = _metadata(bridge["ours"][case])
    model = yaml.safe_load((it_dir / "run_config.yaml").read_text())["model"]
    layout = BRIDGE_LAYOUTS[case]
    assert (model["tensor_model_parallel_size"], model["pipeline_model_parallel_size"]) == \
        (layout.get("tp", 1), layout.get("pp", 1))


# ---------------------------------------------------------------------------------------------- refusals


def _refused(tmp_path, capsys, config, name: str) -> str:
    hf = write_hf_model(tmp_path, name, config)
    capsys.readouterr()
    rc = main(["convert", str(hf), str(tmp_path / "out"), "--to", "megatron-bridge", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert not (tmp_path / "out").exists()
    return err[0]


def test_qwen2_moe_has_no_bridge(tmp_path, capsys):
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=16, num_experts=4,
                            num_experts_per_tok=2, shared_expert_intermediate_size=32, max_position_embeddings=64)
    line = _refused(tmp_path, capsys, config, "qwen2moe")
    assert "Megatron-Bridge 0.6.2 has no bridge for qwen2_moe" in line and "--to megatron-dist" in line, line


def test_qwen3_moe_with_dense_layers_is_refused(tmp_path, capsys):
    """Bridge's Qwen3-MoE bridge makes every layer sparse: a model with dense layers is not its model."""
    config = _configs()["qwen3moe"]
    config.mlp_only_layers = [1]
    line = _refused(tmp_path, capsys, config, "qwen3moe_mixed")
    assert "dense MLP in layer(s) 1" in line and "every layer sparse" in line and "--to megatron-dist" in line, line


def test_biases_bridge_does_not_build_are_refused(tmp_path, capsys):
    """Bridge's Qwen3 bridge builds no biases: a Qwen3 with attention_bias would load as another model."""
    config = _configs()["qwen3"]
    config.attention_bias = True
    line = _refused(tmp_path, capsys, config, "qwen3_bias")
    assert "qwen3 bridge builds qkv bias=False, o_proj and MLP bias=False" in line, line
    assert "qkv_bias=True, o_proj bias=True, mlp bias=False" in line, line


# ------------------------------------------------------------- Transformer-Engine names in Megatron-LM files


def _moe_configs() -> dict:
    from transformers import Qwen2MoeConfig

    mixed = _configs()["qwen3moe"]
    mixed.num_hidden_layers, mixed.mlp_only_layers = 3, [1]  # dense layer 1: per-layer torch_dist keys
    return {"qwen2moe": Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=16,
                                       num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32,
                                       max_position_embeddings=64),
            "qwen3moe_mixed": mixed}


def _te_name(key: str, moe_layers: set[int]) -> str:
    """A local-spec checkpoint key under the Transformer-Engine spec's name: the input norm fused into
    linear_qkv everywhere, the pre-MLP norm into linear_fc1 in dense layers; a MoE layer keeps
    pre_mlp_layernorm (stacked keys: every layer is MoE here)."""
    import re

    m = re.match(r"decoder\.layers\.(\d+\.)?(.*)$", key)
    if m is None:
        return key
    layer = m.group(1)
    moe = layer is None or int(layer[:-1]) in moe_layers
    head = "decoder.layers." + (layer or "")
    fused = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    local = {te: name for name, te in fused.items()}.get(m.group(2), m.group(2))
    if local == "pre_mlp_layernorm.weight" and moe:
        return head + local
    return head + fused.get(local, local)


@pytest.mark.parametrize("case,fmt", [("qwen2moe", "megatron-dist"), ("qwen3moe_mixed", "megatron")])
def test_transformer_engine_norm_names_are_read(tmp_path, monkeypatch, case, fmt):
    """A Megatron-LM checkpoint of a MoE model saved with the TE spec (MoE layers' pre_mlp_layernorm kept,
    the other norms fused) converts to the HF tensors bitwise on both paths: Qwen2-MoE (shared expert)
    in torch_dist with stacked keys, Qwen3-MoE with a dense layer in legacy rank files. (Per-layer
    torch_dist keys, dense and MoE layers mixed, are read by the same lookup.)"""
    import dataclasses

    config = _moe_configs()[case]
    hf = write_hf_model(tmp_path, case, config)
    ckpt = convert(hf, tmp_path / "ckpt", to=fmt, workers=1)
    sparse = {i for i in range(config.num_hidden_layers) if i not in getattr(config, "mlp_only_layers", [])}
    if fmt == "megatron-dist":
        it_dir, md = _metadata(ckpt) if any(p.name.startswith("iter_") for p in ckpt.iterdir()) else \
            (ckpt / "release", pickle.loads((ckpt / "release" / ".metadata").read_bytes()))
        md.state_dict_metadata = {_te_name(k, sparse): v for k, v in md.state_dict_metadata.items()}
        md.storage_data = {dataclasses.replace(i, fqn=_te_name(i.fqn, sparse)): v for i, v in md.storage_data.items()}
        assert any(k.endswith("pre_mlp_layernorm.weight") for k in md.state_dict_metadata)
        (it_dir / ".metadata").write_bytes(pickle.dumps(md))
    else:
        for f in ckpt.rglob("model_optim_rng.pt"):
            data = torch.load(f, weights_only=False)
            data["model"] = {_te_name(k, sparse): v for k, v in data["model"].items()}
            assert any(k.endswith("linear_qkv.layer_norm_weight") for k in data["model"])
            torch.save(data, f)
    want = _hf_tensors(hf)
    for copy_path in ("1", "0"):
        monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
        got = _hf_tensors(convert(ckpt, tmp_path / f"hf{copy_path}", to="hf", workers=1))
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), copy_path
