"""Megatron-Bridge's layout at TP2 x PP2, both ways, against real Megatron-Bridge 0.6.2 run as four gloo ranks on
CPU (tests/bridge_qwen3_vl_oracle.py under ``.venv-bridge``, one 4-rank world for the module: tensor-parallel 2,
pipeline-parallel 2; tests/bridge_run.py starts the ranks).

The single-rank oracles (tests/test_convert_bridge_*.py, tests/test_convert_qwen3_vl_megatron.py,
tests/test_convert_hybrid_vision.py) build every model at TP=PP=1, which cannot see a layout that depends on the TP
size (a fused projection sharded per rank, grouped query/key/value rows, Gated DeltaNet's in_proj and conv1d split
over value heads) or on the stage split (the vision tower, DeepStack and the embedding on the first stage, MTP and
a tied output layer on the last, experts split over expert-TP ranks). Here Bridge builds Qwen3-VL and Qwen3-VL-MoE,
multimodal Qwen3.5 and Qwen3.5-MoE (tower, MTP) and text Qwen3.5 (Gated DeltaNet, tied embeddings) at TP2 x PP2:

* what it writes (``save_megatron_model`` from its own HF import, four ranks' files) -> ``pmz convert --to hf`` ->
  the HF tensors it was built from, bitwise, on the copy path and the torch path;
* what ``pmz convert --to megatron-bridge`` writes, at ``--tp 2 --pp 2`` and at TP1, loads in its own loader
  (``load_model_config`` on our run_config.yaml, ``build_and_load_model``) strictly at TP2 x PP2, every rank's
  every tensor bitwise what that rank of its own HF import holds, the provider's fields those its bridge derives;
* our TP2 x PP2 checkpoint has the keys, global shapes and run_config.yaml model fields of Bridge's own.

The tiny models' vocabularies divide by TP: Bridge builds the embedding unpadded and megatron-core's
``VocabParallelEmbedding`` asserts ``vocab_size % tp == 0``.
"""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from converters.engine import convert

TP, PP = 2, 2
CASES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5_vl", "qwen3_5_vl_moe", "qwen3_5_text")
_VL = "megatron.bridge.models.qwen_vl."
PROVIDERS = {"qwen3_vl": _VL + "qwen3_vl_provider.Qwen3VLModelProvider",
             "qwen3_vl_moe": _VL + "qwen3_vl_provider.Qwen3VLMoEModelProvider",
             "qwen3_5_vl": _VL + "qwen35_vl_provider.Qwen35VLModelProvider",
             "qwen3_5_vl_moe": _VL + "qwen35_vl_provider.Qwen35VLMoEModelProvider",
             "qwen3_5_text": "megatron.bridge.models.gpt_provider.GPTModelProvider"}
MTP = {"qwen3_vl": False, "qwen3_vl_moe": False, "qwen3_5_vl": True, "qwen3_5_vl_moe": True, "qwen3_5_text": False}
# run_config.yaml fields the oracle's CPU run sets otherwise in Bridge's own file (bridge_oracle._cpu,
# bridge_gdn_oracle._cpu); provider fields Bridge derives from the HF directory's path
CPU_RUN_FIELDS = {"moe_token_dispatcher_type", "moe_permute_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                  "persist_layer_norm", "masked_softmax_fusion", "gradient_accumulation_fusion", "apply_rope_fusion",
                  "cross_entropy_loss_fusion", "moe_router_fusion", "fused_residual_rmsnorm", "sequence_parallel",
                  "hf_model_id"}


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(glob.glob(f"{directory}/*.safetensors")):
        out.update(load_file(f))
    return out


def _qwen3_vl(root: Path, name: str) -> str:
    """Qwen3-VL (tests/test_convert_qwen3_vl_megatron.py's ``vl``: untied, tower depth 3 with 4 heads, DeepStack
    [0, 2]) with 4 text layers, two per stage (DeepStack features enter after layers 0 and 1, both on the first),
    vocab 128; Qwen3-VL-MoE (its ``moe``: tied, every layer sparse, 4 experts, DeepStack [1, 0]) with vocab 102.
    At TP2 the MoE provider turns sequence parallelism on and the experts are split over expert-TP 2."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig
    from transformers import Qwen3VLMoeForConditionalGeneration as MoE

    from tests.cases import save_randomized
    from tests.test_convert_qwen3_vl_megatron import _case

    _, kwargs = _case("moe" if name.endswith("moe") else "vl")
    kwargs["text_config"].update(num_hidden_layers=4, vocab_size=102 if name.endswith("moe") else 128)
    torch.manual_seed(31)
    model = MoE(Qwen3VLMoeConfig(**kwargs)) if name.endswith("moe") else \
        Qwen3VLForConditionalGeneration(Qwen3VLConfig(**kwargs))
    return save_randomized(model, root / name)


def _qwen3_5_vl(root: Path, name: str) -> str:
    """Qwen3.5 / Qwen3.5-MoE conditional generation with an MTP block (tests/test_convert_hybrid_vision.py's
    Bridge models: Gated DeltaNet layers then full attention, the tower of 2 heads) with vocab 102."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig
    from transformers import Qwen3_5MoeForConditionalGeneration as MoE

    from tests.test_convert_hybrid_vision import _trained_norms
    from tests.test_hybrid_checkpoints import VISION
    from tests.workers_qwen3_5 import configs
    from tests.workers_qwen3_next import configs as moe_configs

    text = moe_configs()["qwen3_5_moe"] if name.endswith("moe") else configs()["mixed"]
    text.layer_types = ["linear_attention"] * (text.num_hidden_layers - 1) + ["full_attention"]
    text.mtp_num_hidden_layers, text.vocab_size = 1, 102
    torch.manual_seed(32)
    cls, config_cls = (MoE, Qwen3_5MoeConfig) if name.endswith("moe") else (Qwen3_5ForConditionalGeneration,
                                                                            Qwen3_5Config)
    cls(config_cls(text_config=text.to_dict(), vision_config=VISION)).save_pretrained(root / name)
    _trained_norms(str(root / name), mtp=True)
    return str(root / name)


def _qwen3_5_text(root: Path) -> str:
    """Text Qwen3.5 (tests/test_bridge_gdn_oracle.py's: tied embeddings, value heads 4 on key heads 2) with vocab
    102, no MTP: the last stage's output layer is the first stage's embedding. (With MTP too, megatron-core 0.19.2
    cannot save or load it at PP > 1: ``tie_embeddings_and_output_weights_state_dict`` asserts that an MTP stage
    has no ``output_layer.weight``, which it has; language_module.py:497.)"""
    from tests.test_bridge_gdn_oracle import _configs
    from tests.workers_qwen3_5 import write_model

    config = _configs()["qwen3_5"]
    config.vocab_size = 102
    return write_model(root, "qwen3_5_text", config, seed=33)


@pytest.fixture(scope="module")
def bridge(tmp_path_factory):
    """The three HF models, our --to megatron-bridge outputs (TP2 x PP2 and TP1) and one 4-rank Bridge run: it
    writes its own checkpoint of each model at TP2 x PP2 and loads all of ours with its own loader."""
    from tests.bridge_run import run_bridge_oracle

    root = tmp_path_factory.mktemp("bridge_tp2pp2")
    hf = {c: _qwen3_vl(root / "hf", c) for c in ("qwen3_vl", "qwen3_vl_moe")}
    hf.update({c: _qwen3_5_vl(root / "hf", c) for c in ("qwen3_5_vl", "qwen3_5_vl_moe")})
    hf["qwen3_5_text"] = _qwen3_5_text(root / "hf")
    ours = {(c, layout): convert(hf[c], root / f"mb_{c}_{layout}", to="megatron-bridge", workers=1,
                                 **({"tp": TP, "pp": PP} if layout == "tp2pp2" else {}))
            for c in CASES for layout in ("tp2pp2", "tp1")}
    real = {c: root / f"real_{c}" for c in CASES}
    jobs = [{"op": "write", "hf": hf[c], "out": str(real[c]), "mtp": MTP[c]} for c in CASES]
    jobs += [{"op": "load", "ckpt": str(ours[key]), "hf": hf[key[0]], "mtp": MTP[key[0]]} for key in ours]
    results = run_bridge_oracle("bridge_qwen3_vl_oracle.py", jobs, root, timeout=600, tp=TP, pp=PP)
    return {"hf": hf, "ours": ours, "real": real, "writes": dict(zip(CASES, results)),
            "loads": dict(zip(ours, results[len(CASES):]))}


def _it_dir(ckpt) -> str:
    (it,) = glob.glob(f"{ckpt}/iter_*")
    return it


@pytest.mark.parametrize("copy_path", ["1", "0"], ids=["copy-path", "torch-path"])
@pytest.mark.parametrize("case", CASES)
def test_bridge_tp2_pp2_checkpoint_to_hf_is_bitwise(bridge, tmp_path, monkeypatch, case, copy_path):
    """Bridge's own TP2 x PP2 import of the HF directory, saved by its four ranks -> pmz -> HF: every tensor
    bitwise (tower, DeepStack mergers, Gated DeltaNet, MTP)."""
    monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
    it = _it_dir(bridge["real"][case])
    model = yaml.safe_load(Path(f"{it}/run_config.yaml").read_text())["model"]
    assert (model["tensor_model_parallel_size"], model["pipeline_model_parallel_size"]) == (TP, PP)
    assert len(glob.glob(f"{it}/*.distcp")) == TP * PP  # every rank wrote its shard
    out = convert(bridge["real"][case], tmp_path / "hf", to="hf", hf_config=bridge["hf"][case], workers=1)
    got, want = _tensors(out), _tensors(bridge["hf"][case])
    assert sorted(got) == sorted(want)
    assert [k for k in want if not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))] == []


@pytest.mark.parametrize("layout", ["tp2pp2", "tp1"])
@pytest.mark.parametrize("case", CASES)
def test_real_bridge_at_tp2_pp2_loads_what_pmz_writes(bridge, case, layout):
    """Bridge's own loader at TP2 x PP2 takes our checkpoint (written at TP2 x PP2, or at TP1: torch_dist holds
    global tensors) strictly, and on every rank each tensor equals what that rank of its own HF import holds."""
    load = bridge["loads"][(case, layout)]
    assert load["loader"] == PROVIDERS[case], load
    assert len(load["compared_per_rank"]) == TP * PP and min(load["compared_per_rank"]) >= 15, load
    assert (load["mismatched"], load["missing"], load["unexpected"]) == ([], [], []), load
    assert set(load["config_diff"]) <= {"hf_model_id"}, load["config_diff"]


@pytest.mark.parametrize("case", CASES)
def test_pmz_tp2_pp2_checkpoint_is_bridges(bridge, case):
    """Our --tp 2 --pp 2 checkpoint holds the keys, global shapes and ``_extra_state`` items of Bridge's own TP2 x
    PP2 save (but its common state) and the same run_config.yaml model fields, parallel sizes included."""
    ours = FileSystemReader(_it_dir(bridge["ours"][(case, "tp2pp2")])).read_metadata().state_dict_metadata
    assert {k: list(v.size) if hasattr(v, "size") else "object" for k, v in ours.items()} == \
        {k: v for k, v in bridge["writes"][case]["keys"].items() if not k.startswith("common_state")}
    mine = yaml.safe_load(Path(f"{_it_dir(bridge['ours'][(case, 'tp2pp2')])}/run_config.yaml").read_text())["model"]
    real = yaml.safe_load(bridge["writes"][case]["run_config"])["model"]
    for nested in ("vision_config", "hf_text_config"):  # ours name the fields transformers' config sets
        if nested in mine:
            assert {k: (v, real[nested].get(k)) for k, v in mine.pop(nested).items() if real[nested].get(k) != v} == {}
    assert {k: (v, real.get(k, "absent")) for k, v in mine.items() if k not in CPU_RUN_FIELDS and real.get(k) != v} \
        == {}
    assert (mine["tensor_model_parallel_size"], mine["pipeline_model_parallel_size"]) == (TP, PP)

