"""``pmz convert`` for the Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) HF <-> Megatron legacy and
torch_dist, in Megatron-Bridge 0.6.2's layout, MTP block carried.

The HF checkpoints are transformers' own (``save_pretrained`` of tiny random models, tests/workers_qwen3_5 and
tests/workers_qwen3_next configs), plus an MTP block the test adds to the safetensors (transformers neither
writes nor loads ``mtp.*``).

* HF -> legacy (tp2 pp2, ep2 for the MoE models; pp2 x vpp2) / torch_dist -> HF, bitwise, MTP included; a
  checkpoint without MTP converts too (and gets none).
* Megatron -> Megatron reshards (legacy -> torch_dist -> legacy, TP/PP/EP changed and back) bitwise, the
  GDN output norms set to values that do not survive a trip through HF (reshards never pass through it).
* The Megatron tensors against an independent reading of Bridge's mapping (``qwen35_bridge.py``,
  ``qwen3_next_bridge.py``, ``param_mapping.py``: ``merge_qkv_weights`` with ``attention_output_gate``,
  ``merge_gdn_linear_weights`` per TP rank, ``GDNConv1dMapping``, ``RMSNorm2ZeroCenteredRMSNormMapping``, the
  MTP mappings), written out here with plain torch: legacy TP shards and torch_dist's split components.
* Megatron args: the fields megatron-core needs; an HF config built from them alone gives transformers'
  logits; args contradicting the HF config, a TP the linear heads cannot take, mis-shaped tensors: one line,
  nothing written.
* The output norm's ``w - 1`` over every bf16 value: exact where ``w - 1`` is representable, and which values
  come back bitwise (the counts docs/formats.md states).
"""

from __future__ import annotations

import glob
import json
import shutil
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters.engine import convert
from models.common.errors import CheckpointError
from parallel.config import ParallelConfigError
from tests.cases import snapshot
from tests.test_convert_errors import expect_failure, run_cli

LIN, FULL = "linear_attention", "full_attention"


def _configs() -> dict:
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    common = dict(vocab_size=101, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=64, tie_word_embeddings=False)
    moe = dict(moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts_per_tok=2)
    return {
        # value heads 4 on 2 key heads, dv != dk, partial rotary 0.25; layers: linear, linear, full, linear
        "qwen3_5": Qwen3_5TextConfig(**common, intermediate_size=48, num_hidden_layers=4,
                                     layer_types=[LIN, LIN, FULL, LIN], linear_num_key_heads=2,
                                     linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12),
        "qwen3_5_moe": Qwen3_5MoeTextConfig(**common, **moe, num_experts=4, num_hidden_layers=2,
                                            layer_types=[LIN, FULL], linear_num_key_heads=2,
                                            linear_num_value_heads=4, linear_key_head_dim=8,
                                            linear_value_head_dim=12),
        # 4 key-head groups interleaved, layer 1 dense (mlp_only_layers), top-k not renormalised
        "qwen3_next": Qwen3NextConfig(**common, **moe, num_experts=4, norm_topk_prob=False, mlp_only_layers=[1],
                                      intermediate_size=48, num_hidden_layers=4, layer_types=[LIN, LIN, FULL, LIN],
                                      linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                                      linear_value_head_dim=8),
    }


def add_mtp(path: str, seed: int) -> None:
    """An MTP block in the safetensors (a full-attention layer with the model's MLP, its fc and norms) and
    ``mtp_num_hidden_layers`` in config.json, as real Qwen3.5 / Qwen3-Next checkpoints hold them."""
    tensors = load_file(f"{path}/model.safetensors")
    config = json.loads(Path(path, "config.json").read_text())
    full = config["layer_types"].index(FULL)
    gen, h = torch.Generator().manual_seed(seed), config["hidden_size"]
    for name, t in list(tensors.items()):
        if name.startswith(f"model.layers.{full}."):
            tensors["mtp.layers.0." + name.split(".", 3)[3]] = torch.randn(t.shape, generator=gen) * 0.05
    tensors["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.05
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.randn(h, generator=gen) * 0.1
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    Path(path, "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}, indent=2))


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict[str, str]:
    """name -> HF directory: the three models with MTP, and Qwen3.5 without."""
    from tests.workers_qwen3_5 import write_model

    root = tmp_path_factory.mktemp("hybrid_hf")
    out = {}
    for seed, (name, config) in enumerate(_configs().items()):
        out[name] = write_model(root, name, config, seed + 11)
        if name == "qwen3_5":
            out["qwen3_5_no_mtp"] = str(shutil.copytree(out[name], root / "qwen3_5_no_mtp"))
        add_mtp(out[name], seed)
    return out


def hf_tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(glob.glob(f"{path}/*.safetensors")):
        out.update(load_file(f))
    return out


def legacy_state(root: str) -> dict[tuple[str, str, str], torch.Tensor]:
    """(rank folder, chunk, key) -> tensor of every rank file of a legacy checkpoint."""
    out = {}
    for f in sorted(glob.glob(f"{root}/*/mp_rank_*/model_optim_rng.pt")):
        data = torch.load(f, weights_only=False)
        for chunk, state in data.items():
            if chunk.startswith("model"):
                out.update(((Path(f).parent.name, chunk, k), t) for k, t in state.items() if t is not None)
    return out


def args_of(root: str):
    return torch.load(glob.glob(f"{root}/*/mp_rank_*/model_optim_rng.pt")[0], weights_only=False)["args"]


def dist_state(root: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    it = glob.glob(f"{root}/iter_*")[0] if glob.glob(f"{root}/iter_*") else glob.glob(f"{root}/release")[0]
    meta = FileSystemReader(it).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if isinstance(m, TensorStorageMetadata)}
    load(state, checkpoint_id=it, no_dist=True)
    return state


def assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:8]
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad[:8]


LAYOUTS = [("megatron", dict(tp=2, pp=2)), ("megatron", dict(pp=2, vpp=2)), ("megatron-dist", dict(tp=2))]


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_no_mtp"])
def test_round_trips_are_bitwise(hf, tmp_path, name):
    """HF -> Megatron (legacy tp2 pp2 (ep2), pp2 x vpp2; torch_dist tp2) -> HF gives every tensor back bitwise,
    the MTP block included; without one, none appears."""
    src = hf[name]
    ref = hf_tensors(src)
    assert any(k.startswith("mtp.") for k in ref) == (name != "qwen3_5_no_mtp")
    layouts = LAYOUTS[:2] if name == "qwen3_5_moe" else LAYOUTS  # 2 layers: no pp2 x vpp2
    if name == "qwen3_5_moe":
        layouts = [("megatron", dict(tp=2, pp=2, ep=2)), ("megatron-dist", dict(tp=2))]
    if name == "qwen3_next":
        layouts = [("megatron", dict(tp=2, pp=2, ep=2))] + LAYOUTS[1:]
    for i, (to, kw) in enumerate(layouts):
        mc, back = tmp_path / f"mc{i}", tmp_path / f"hf{i}"
        convert(src, mc, to=to, workers=1, **kw)
        convert(mc, back, to="hf", workers=1)
        assert_same(ref, hf_tensors(str(back)))
        assert json.loads((back / "config.json").read_text()) == json.loads(Path(src, "config.json").read_text())
        if to == "megatron":
            args = args_of(str(mc))
            assert args.mtp_num_layers == (None if name == "qwen3_5_no_mtp" else 1)
            pp, vpp = kw.get("pp", 1), kw.get("vpp", 1)
            last_chunk = "model" if vpp == 1 else f"model{vpp - 1}"
            mtp = [(folder, chunk) for folder, chunk, key in legacy_state(str(mc)) if key.startswith("mtp.")]
            assert bool(mtp) == (name != "qwen3_5_no_mtp")
            assert all(int(folder.split("_")[3]) == pp - 1 and chunk == last_chunk for folder, chunk in mtp), \
                "MTP tensors off the last pipeline stage's last chunk"


def test_megatron_reshards_are_bitwise(hf, tmp_path):
    """legacy (tp2 pp2 ep2) -> torch_dist (tp1) -> legacy (tp1) -> legacy (tp2 pp2 ep2): every rank file's
    tensors come back bitwise, output norms whose value + 1 rounds in HF included (a reshard never holds the
    HF value), and the MTP block on the last stage."""
    a = tmp_path / "a"
    convert(hf["qwen3_next"], a, to="megatron", tp=2, pp=2, ep=2, workers=1)
    for f in glob.glob(f"{a}/*/mp_rank_*/model_optim_rng.pt"):
        data = torch.load(f, weights_only=False)
        for state in (v for k, v in data.items() if k.startswith("model")):
            for key in [k for k in state if k.endswith("out_norm.weight")]:
                state[key] = 1e-3 * torch.arange(1, state[key].numel() + 1, dtype=state[key].dtype)
        torch.save(data, f)
    value = 1e-3 * torch.arange(1, 9, dtype=torch.float32)  # the norms' [dv = 8] values
    assert not torch.equal((value + 1) - 1, value)  # they do not survive HF's + 1 (fp32)
    convert(a, tmp_path / "b", to="megatron-dist", tp=1, pp=1, ep=1, workers=1)
    convert(tmp_path / "b", tmp_path / "c", to="megatron", tp=1, pp=1, ep=1, workers=1)
    convert(tmp_path / "c", tmp_path / "d", to="megatron", tp=2, pp=2, ep=2, workers=1)
    assert_same(legacy_state(str(a)), legacy_state(str(tmp_path / "d")))
    dist = dist_state(str(tmp_path / "b"))
    norms = [k for k in dist if k.endswith("out_norm.weight")]
    assert len(norms) == 3 and all(torch.equal(dist[k], value) for k in norms)
