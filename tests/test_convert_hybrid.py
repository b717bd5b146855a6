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

import copy
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
from tests.bridge_run import run_bridge_oracle
from tests.test_convert_errors import expect_failure

LIN, FULL = "linear_attention", "full_attention"


def _configs() -> dict:
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    common = dict(vocab_size=101, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=64, tie_word_embeddings=False)
    moe = dict(moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts_per_tok=2)
    return {
        # value heads 4 on 2 key heads, dv != dk, partial rotary 0.25; every 4th layer full attention (the last:
        # megatron-core builds the MTP layer from the last layer's spec)
        "qwen3_5": Qwen3_5TextConfig(**common, intermediate_size=48, num_hidden_layers=4,
                                     layer_types=[LIN, LIN, LIN, FULL], linear_num_key_heads=2,
                                     linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12),
        "qwen3_5_moe": Qwen3_5MoeTextConfig(**common, **moe, num_experts=4, num_hidden_layers=2,
                                            layer_types=[LIN, FULL], linear_num_key_heads=2,
                                            linear_num_value_heads=4, linear_key_head_dim=8,
                                            linear_value_head_dim=12),
        # 4 key-head groups interleaved, layer 1 dense (mlp_only_layers), top-k not renormalised, layer kinds not
        # periodic (linear_attention_freq a list)
        "qwen3_next": Qwen3NextConfig(**common, **moe, num_experts=4, norm_topk_prob=False, mlp_only_layers=[1],
                                      intermediate_size=48, num_hidden_layers=4, layer_types=[FULL, LIN, LIN, FULL],
                                      linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                                      linear_value_head_dim=8),
    }


def add_mtp(path, seed: int) -> None:
    """An MTP block in the safetensors (a full-attention layer with the model's MLP, its fc and norms, random
    values) and ``mtp_num_hidden_layers: 1`` in config.json, as real Qwen3.5 / Qwen3-Next checkpoints hold them;
    a conditional-generation checkpoint's at the top level, declared in its ``text_config``."""
    tensors = load_file(f"{path}/model.safetensors")
    config = json.loads(Path(path, "config.json").read_text())
    text = config.get("text_config", config)
    full = text["layer_types"].index(FULL)
    gen, h = torch.Generator().manual_seed(seed), text["hidden_size"]
    layer = f"model.language_model.layers.{full}." if "text_config" in config else f"model.layers.{full}."
    for name, t in list(tensors.items()):
        if name.startswith(layer):
            tensors["mtp.layers.0." + name[len(layer):]] = torch.randn(t.shape, generator=gen) * 0.05
    tensors["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.05
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.randn(h, generator=gen) * 0.1
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    text["mtp_num_hidden_layers"] = 1
    Path(path, "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict[str, str]:
    """name -> HF directory: the three models with MTP (Qwen3-Next also with every layer sparse, as Bridge
    builds it), and Qwen3.5 without."""
    from tests.workers_qwen3_5 import write_model

    root = tmp_path_factory.mktemp("hybrid_hf")
    out = {}
    configs = _configs()
    configs["qwen3_next_all_sparse"] = copy.deepcopy(configs["qwen3_next"])
    configs["qwen3_next_all_sparse"].mlp_only_layers = []  # as Bridge builds Qwen3-Next: MoE on every layer
    for seed, (name, config) in enumerate(configs.items()):
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
        layouts = [("megatron", dict(tp=2, pp=2, ep=2)), ("megatron", dict(tp=2, ep=2, moe_grouped_gemm=True)),
                   ("megatron-dist", dict(tp=2))]  # grouped: Transformer Engine's TEGroupedMLP (weight{i})
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
            assert all((pp == 1 or int(folder.split("_")[3]) == pp - 1) and chunk == last_chunk
                       for folder, chunk in mtp), "MTP tensors off the last pipeline stage's last chunk"
            if kw.get("moe_grouped_gemm"):
                assert any(key.endswith("mlp.experts.linear_fc1.weight1") for _, _, key in legacy_state(str(mc)))


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
    assert len(norms) == 2 and all(torch.equal(dist[k], value) for k in norms)


def test_uneven_tp1_legacy_reshards(hf, tmp_path):
    """A TP 1 legacy source (one shard per tensor: the reader hands its mapped views on as they are) with an
    uneven pipeline split -> torch_dist and -> legacy TP 2 -> HF: bitwise, the MTP block on the last stage."""
    convert(hf["qwen3_5"], tmp_path / "a", to="megatron", pp=2, first_stage_layers=1, workers=1)
    convert(tmp_path / "a", tmp_path / "b", to="megatron-dist", workers=1)
    convert(tmp_path / "a", tmp_path / "c", to="megatron", tp=2, pp=1, workers=1)
    for mc in ("b", "c"):
        assert_same(hf_tensors(hf["qwen3_5"]), hf_tensors(str(convert(tmp_path / mc, tmp_path / f"{mc}_hf", to="hf",
                                                                      workers=1))))


# ------------------------------------------------------------------- Megatron names and layouts (Bridge's mapping)

def _bridge_layer(hf: dict, cfg: dict, i: int, tp: int, r: int, hf_layer: str, mc_layer: str,
                  sparse: bool) -> dict[str, torch.Tensor]:
    """TP rank r's Megatron tensors of decoder layer ``i`` as Megatron-Bridge maps them (names and values from
    ``qwen35_bridge`` / ``qwen3_next_bridge`` and ``param_mapping``, re-derived here head group by head group;
    ``tp=1``: torch_dist's global tensors, in_proj / conv1d split into their named components)."""
    h, hd, nh, ng = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    L, M = hf_layer, mc_layer
    out = {}

    def rows(t, n, k=r):  # rank k's contiguous rows of n equal chunks
        return t.reshape(n, -1, *t.shape[1:])[k].reshape(-1, *t.shape[1:])

    if i < len(cfg["layer_types"]) and cfg["layer_types"][i] == LIN:  # the MTP layer (i = L) is full attention
        hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv, per = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], hv // hk
        if f"{L}linear_attn.in_proj_qkvz.weight" in hf:  # Qwen3-Next: per key-head group [q k v z], [b a]
            g = hf[f"{L}linear_attn.in_proj_qkvz.weight"].reshape(hk, 2 * dk + 2 * per * dv, h)
            q, k, v, z = (c.reshape(-1, h) for c in g.split([dk, dk, per * dv, per * dv], dim=1))
            b, a = (c.reshape(-1, h) for c in hf[f"{L}linear_attn.in_proj_ba.weight"].reshape(hk, 2 * per, h)
                    .split([per, per], dim=1))
        else:  # Qwen3.5: [q; k; v], z, b, a
            q, k, v = hf[f"{L}linear_attn.in_proj_qkv.weight"].split([hk * dk, hk * dk, hv * dv])
            z, b, a = (hf[f"{L}linear_attn.in_proj_{p}.weight"] for p in "zba")
        comps = dict(query=q, key=k, value=v, z=z, beta=b, alpha=a)
        conv = dict(zip(("query", "key", "value"), hf[f"{L}linear_attn.conv1d.weight"].split([hk * dk, hk * dk,
                                                                                             hv * dv])))
        if tp == 1:
            out.update({f"{M}self_attention.in_proj.weight.{n}": t for n, t in comps.items()})
            out.update({f"{M}self_attention.conv1d.weight.{n}": t for n, t in conv.items()})
        else:  # merge_gdn_linear_weights(tp): each rank's key-head groups, [q k v z b a] of them
            out[f"{M}self_attention.in_proj.weight"] = torch.cat([rows(t, tp) for t in comps.values()])
            out[f"{M}self_attention.conv1d.weight"] = torch.cat([rows(t, tp) for t in conv.values()])
        norm = hf[f"{L}linear_attn.norm.weight"]
        out.update({f"{M}self_attention.in_proj.layer_norm_weight": hf[f"{L}input_layernorm.weight"],
                    f"{M}self_attention.A_log": rows(hf[f"{L}linear_attn.A_log"], tp),
                    f"{M}self_attention.dt_bias": rows(hf[f"{L}linear_attn.dt_bias"], tp),
                    f"{M}self_attention.out_norm.weight": (norm.double() - 1).to(norm.dtype),  # zero-centred
                    f"{M}self_attention.out_proj.weight": rows(hf[f"{L}linear_attn.out_proj.weight"].t(), tp).t()})
    else:  # gated attention: per query group [its heads' queries, their gates, k, v] (attention_output_gate)
        heads = hf[f"{L}self_attn.q_proj.weight"].reshape(nh, 2, hd, h)
        kk, vv = (hf[f"{L}self_attn.{p}_proj.weight"].reshape(ng, hd, h) for p in "kv")
        groups = [torch.cat([heads[j * nh // ng:(j + 1) * nh // ng, 0].reshape(-1, h),
                             heads[j * nh // ng:(j + 1) * nh // ng, 1].reshape(-1, h), kk[j], vv[j]])
                  for j in range(ng)]
        out.update({f"{M}self_attention.linear_qkv.weight": rows(torch.cat(groups), tp),
                    f"{M}self_attention.linear_qkv.layer_norm_weight": hf[f"{L}input_layernorm.weight"],
                    f"{M}self_attention.q_layernorm.weight": hf[f"{L}self_attn.q_norm.weight"],
                    f"{M}self_attention.k_layernorm.weight": hf[f"{L}self_attn.k_norm.weight"],
                    f"{M}self_attention.linear_proj.weight": rows(hf[f"{L}self_attn.o_proj.weight"].t(), tp).t()})
    if sparse:
        out[f"{M}pre_mlp_layernorm.weight"] = hf[f"{L}post_attention_layernorm.weight"]
        out[f"{M}mlp.router.weight"] = hf[f"{L}mlp.gate.weight"]
        out[f"{M}mlp.shared_experts.gate_weight"] = hf[f"{L}mlp.shared_expert_gate.weight"]
        mlps = [("mlp.shared_experts.", f"{L}mlp.shared_expert.")]
        experts = cfg["num_experts"]
        if tp == 1:  # torch_dist: experts stacked per layer
            for j, p in ((1, ("gate", "up")), (2, ("down",))):
                out[f"{M}mlp.experts.experts.linear_fc{j}.weight"] = torch.stack([torch.cat([
                    hf[f"{L}mlp.experts.{e}.{n}_proj.weight"] for n in p]) for e in range(experts)])
        else:
            mlps += [(f"mlp.experts.local_experts.{e}.", f"{L}mlp.experts.{e}.") for e in range(experts)]
    else:
        out[f"{M}mlp.linear_fc1.layer_norm_weight"] = hf[f"{L}post_attention_layernorm.weight"]
        mlps = [("mlp.", f"{L}mlp.")]
    for mc, hp in mlps:
        out[f"{M}{mc}linear_fc1.weight"] = torch.cat([rows(hf[f"{hp}gate_proj.weight"], tp),
                                                     rows(hf[f"{hp}up_proj.weight"], tp)])
        out[f"{M}{mc}linear_fc2.weight"] = rows(hf[f"{hp}down_proj.weight"].t(), tp).t()
    return out


def bridge_layout(hf_dir: str, tp: int, r: int) -> dict[str, torch.Tensor]:
    """Every Megatron tensor of TP rank r (pp 1, ep 1; ``tp=1``: torch_dist's tensors) as Bridge maps the HF
    checkpoint: embedding (padded to 128 * tp rows), layers, final norm, output layer, MTP block."""
    hf, cfg = hf_tensors(hf_dir), json.loads(Path(hf_dir, "config.json").read_text())
    L, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
    padded = -(-vocab // (128 * tp)) * 128 * tp

    def vocab_rows(t):
        full = torch.cat([t, t.new_zeros(padded - vocab, t.shape[1])])
        return full.reshape(tp, -1, t.shape[1])[r]

    sparse = [("num_experts" in cfg) and i not in cfg.get("mlp_only_layers", []) for i in range(L)]
    out = {"embedding.word_embeddings.weight": vocab_rows(hf["model.embed_tokens.weight"]),
           "decoder.final_layernorm.weight": hf["model.norm.weight"],
           "output_layer.weight": vocab_rows(hf["lm_head.weight"])}
    for i in range(L):
        out.update(_bridge_layer(hf, cfg, i, tp, r, f"model.layers.{i}.", f"decoder.layers.{i}.", sparse[i]))
    mtp_layer = "transformer_layer" if tp == 1 else "mtp_model_layer"  # torch_dist renames it
    out.update(_bridge_layer(hf, cfg, L, tp, r, "mtp.layers.0.", f"mtp.layers.0.{mtp_layer}.", "num_experts" in cfg))
    fc = hf["mtp.fc.weight"]
    out.update({"mtp.layers.0.eh_proj.weight": fc.reshape(tp, -1, fc.shape[1])[r],
                "mtp.layers.0.enorm.weight": hf["mtp.pre_fc_norm_embedding.weight"],
                "mtp.layers.0.hnorm.weight": hf["mtp.pre_fc_norm_hidden.weight"],
                "mtp.layers.0.final_layernorm.weight": hf["mtp.norm.weight"]})
    return out


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_megatron_tensors_are_bridges(hf, tmp_path, name):
    """Legacy TP2 rank files and torch_dist hold exactly Bridge's tensors (names, shapes, values): the gated
    ``linear_qkv``, GDN ``in_proj`` / ``conv1d`` per TP rank and split into components, ``out_norm`` minus one,
    the fused norms, experts, the MTP block (``mtp_model_layer``, in torch_dist ``transformer_layer``)."""
    convert(hf[name], tmp_path / "legacy", to="megatron", tp=2, workers=1)
    state = legacy_state(str(tmp_path / "legacy"))
    for r in range(2):
        got = {k: t for (folder, _, k), t in state.items() if folder == f"mp_rank_{r:02d}"
               and not k.endswith("_extra_state")}
        assert_same(bridge_layout(hf[name], 2, r), got)
    convert(hf[name], tmp_path / "dist", to="megatron-dist", workers=1)
    assert_same(bridge_layout(hf[name], 1, 0), dist_state(str(tmp_path / "dist")))


# ----------------------------------------------------------------------------------------------- Megatron args

@torch.no_grad()
def _logits(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    return model(input_ids=ids).logits


def test_args_describe_the_model(hf, tmp_path):
    """The legacy args carry what megatron-core needs for these models; without the ``hf_config/`` sidecar
    pmz builds config.json from them alone and transformers' logits on it are the source model's. Megatron
    stores Qwen3.5-MoE and Qwen3-Next alike: args without the recorded HF model type need ``--arch``."""
    mc = tmp_path / "mc"
    convert(hf["qwen3_5"], mc, to="megatron", tp=2, workers=1)
    args = vars(args_of(str(mc)))
    cfg = json.loads(Path(hf["qwen3_5"], "config.json").read_text())
    expected = dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                    linear_conv_kernel_dim=4, attention_output_gate=True, layernorm_zero_centered_gamma=True,
                    rotary_percent=0.25, qk_layernorm=True, kv_channels=8, num_query_groups=2, mtp_num_layers=1,
                    transformer_impl="transformer_engine", hf_model_type="qwen3_5_text", normalization="RMSNorm",
                    untie_embeddings_and_output_weights=True)
    assert {k: args[k] for k in expected} == expected
    assert cfg["layer_types"] == [LIN, LIN, LIN, FULL]  # linear_attention_freq 4: every 4th layer full attention
    shutil.rmtree(mc / "hf_config")
    convert(mc, tmp_path / "back", to="hf", workers=1)
    assert_same(hf_tensors(hf["qwen3_5"]), hf_tensors(str(tmp_path / "back")))
    assert torch.equal(_logits(str(tmp_path / "back")), _logits(hf["qwen3_5"]))

    nx = tmp_path / "next"
    convert(hf["qwen3_next"], nx, to="megatron-dist", workers=1)
    data = torch.load(glob.glob(f"{nx}/*/common.pt")[0], weights_only=False)
    del data["args"].hf_model_type
    torch.save(data, glob.glob(f"{nx}/*/common.pt")[0])
    shutil.rmtree(nx / "hf_config")
    with pytest.raises(CheckpointError, match="store Qwen3.5-MoE and Qwen3-Next alike: pass --arch qwen3_5_moe or "
                                              "--arch qwen3_next"):
        convert(nx, tmp_path / "x", to="hf", workers=1)
    convert(nx, tmp_path / "next_hf", to="hf", workers=1, arch="qwen3_next")
    assert_same(hf_tensors(hf["qwen3_next"]), hf_tensors(str(tmp_path / "next_hf")))
    assert torch.equal(_logits(str(tmp_path / "next_hf")), _logits(hf["qwen3_next"]))


@pytest.mark.parametrize("name, field, value, named", [
    ("qwen3_5", "linear_num_value_heads", 2, "linear_num_value_heads=2 vs args' 4"),
    ("qwen3_5", "layer_types", [LIN, FULL, LIN, LIN], "vs linear_attention_freq 4"),
    ("qwen3_5", "model_type", "qwen3", "the Megatron args describe a Gated DeltaNet hybrid"),
    ("qwen3_next", "norm_topk_prob", True, "norm_topk_prob=True vs args' False"),
])
def test_args_contradicting_the_hf_config_are_refused(hf, tmp_path, capsys, name, field, value, named):
    """The ``hf_config/`` beside a Megatron checkpoint must describe the model its args do."""
    mc = tmp_path / "mc"
    convert(hf[name], mc, to="megatron", workers=1)
    cfg_path = mc / "hf_config" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg[field] = value
    cfg_path.write_text(json.dumps(cfg))
    expect_failure(capsys, mc, tmp_path / "out" / "hf", names=(named, "does not match" if field != "model_type"
                                                              else "a qwen3 model"))


# --------------------------------------------------------------------------------------------------- bad input

def test_tp_the_linear_heads_cannot_take_is_refused(hf, tmp_path, capsys):
    """Megatron splits Gated DeltaNet by key-head group: --tp must divide linear_num_key_heads (one line naming
    the numbers, before anything is written)."""
    expect_failure(capsys, hf["qwen3_5"], tmp_path / "out" / "mc", to="megatron", api=dict(tp=4), cli=("--tp", "4"),
                   exc_type=ParallelConfigError, names=("linear_num_key_heads=2 is not divisible by tp=4",))


def _edit_legacy(root: Path, key_end: str, fn) -> None:
    for f in glob.glob(f"{root}/*/mp_rank_*/model_optim_rng.pt"):
        data = torch.load(f, weights_only=False)
        for state in (v for k, v in data.items() if k.startswith("model")):
            for key in [k for k in state if k.endswith(key_end)]:
                state[key] = fn(state[key])
        torch.save(data, f)


def test_mis_shaped_and_partial_checkpoints_are_refused(hf, tmp_path, capsys):
    """Tensors that do not fit the config (HF, legacy and torch_dist) and MTP blocks pmz does not carry (a
    second layer, a block without its layer): one line naming the tensor and the numbers, nothing written."""
    bad_hf = tmp_path / "bad_hf"
    shutil.copytree(hf["qwen3_5"], bad_hf)
    t = load_file(f"{bad_hf}/model.safetensors")
    t["model.layers.0.linear_attn.in_proj_z.weight"] = t["model.layers.0.linear_attn.in_proj_z.weight"][:-1]
    save_file(t, f"{bad_hf}/model.safetensors", metadata={"format": "pt"})
    expect_failure(capsys, bad_hf, tmp_path / "out" / "a", to="megatron",
                   names=("model.layers.0.linear_attn.in_proj_z.weight (47, 32) (expected (48, 32))",))

    legacy = tmp_path / "legacy"
    convert(hf["qwen3_5"], legacy, to="megatron", tp=2, workers=1)
    _edit_legacy(legacy, "layers.0.self_attention.conv1d.weight", lambda x: x[:-1])
    expect_failure(capsys, legacy, tmp_path / "out" / "b",
                   names=("decoder.layers.0.self_attention.conv1d.weight has shape (39, 1, 4) per TP rank",
                          "(40, 1, 4) (tp=2)"))

    dist = tmp_path / "dist"
    convert(hf["qwen3_5"], dist, to="megatron-dist", workers=1)
    shutil.rmtree(dist / "hf_config")
    common = glob.glob(f"{dist}/*/common.pt")[0]
    torch.save({k: v for k, v in torch.load(common, weights_only=False).items() if k != "args"}, common)  # as Bridge
    cfg = json.loads(Path(hf["qwen3_5"], "config.json").read_text())
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps({**cfg, "linear_value_head_dim": 6}))
    expect_failure(capsys, dist, tmp_path / "out" / "c", api=dict(hf_config=str(cfg_dir)),
                   cli=("--hf-config", str(cfg_dir)),
                   names=("decoder.layers.0.self_attention.in_proj.weight.value has global shape (48, 32), the "
                          "config implies (24, 32)",))

    two = tmp_path / "two_mtp"
    shutil.copytree(hf["qwen3_5"], two)
    t = load_file(f"{two}/model.safetensors")
    t.update({k.replace("mtp.layers.0.", "mtp.layers.1."): v.clone() for k, v in t.items()
              if k.startswith("mtp.layers.0.")})
    save_file(t, f"{two}/model.safetensors", metadata={"format": "pt"})
    expect_failure(capsys, two, tmp_path / "out" / "d", to="megatron",
                   names=("an MTP block with layers 0, 1: pmz carries exactly one MTP layer",))
    headless = tmp_path / "headless_mtp"
    shutil.copytree(hf["qwen3_5"], headless)
    t = {k: v for k, v in load_file(f"{headless}/model.safetensors").items() if not k.startswith("mtp.fc")}
    save_file(t, f"{headless}/model.safetensors", metadata={"format": "pt"})
    expect_failure(capsys, headless, tmp_path / "out" / "e", to="megatron", names=("missing tensor(s): mtp.fc.weight",))


def _fuse_experts(src: str, dst: Path) -> None:
    """``src`` with every layer's experts (the MTP layer's too) stored fused, as transformers holds them:
    ``mlp.experts.gate_up_proj [E, 2F, H]`` (per expert gate rows, then up rows), ``down_proj [E, H, F]``."""
    shutil.copytree(src, dst)
    t = load_file(f"{dst}/model.safetensors")
    for prefix in sorted({k.split("experts.")[0] + "experts." for k in t if ".mlp.experts." in k}):
        experts = range(len({k for k in t if k.startswith(prefix) and k.endswith(".down_proj.weight")}))
        t[prefix + "gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{prefix}{e}.gate_proj.weight"),
                                                             t.pop(f"{prefix}{e}.up_proj.weight")]) for e in experts])
        t[prefix + "down_proj"] = torch.stack([t.pop(f"{prefix}{e}.down_proj.weight") for e in experts])
    save_file(t, f"{dst}/model.safetensors", metadata={"format": "pt"})


def test_fused_experts_are_read(hf, tmp_path, capsys):
    """Experts stored fused (decoder and MTP layers) are read as per-expert views of the fused tensors (copy
    path and torch path): HF and HF -> torch_dist -> HF give transformers' per-expert tensors bitwise. A fused
    tensor of another shape, or a layer holding both forms, is refused in one line."""
    fused = tmp_path / "fused"
    _fuse_experts(hf["qwen3_5_moe"], fused)
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in load_file(f"{fused}/model.safetensors")
    want = hf_tensors(hf["qwen3_5_moe"])
    for path in ("1", "0"):
        assert_same(want, hf_tensors(str(convert(fused, tmp_path / f"hf{path}", to="hf", workers=1))))
    convert(fused, tmp_path / "dist", to="megatron-dist", workers=1)
    assert_same(want, hf_tensors(str(convert(tmp_path / "dist", tmp_path / "back", to="hf", workers=1))))

    bad = tmp_path / "bad"
    shutil.copytree(fused, bad)
    t = load_file(f"{bad}/model.safetensors")
    t["model.layers.1.mlp.experts.down_proj"] = t["model.layers.1.mlp.experts.down_proj"].transpose(1, 2).contiguous()
    save_file(t, f"{bad}/model.safetensors", metadata={"format": "pt"})
    expect_failure(capsys, bad, tmp_path / "out" / "f", names=(
        "fused experts model.layers.1.mlp.experts.down_proj have shape (4, 16, 32), the config implies (4, 32, 16)",))
    both = tmp_path / "both"
    shutil.copytree(fused, both)
    t = load_file(f"{both}/model.safetensors")
    t["model.layers.0.mlp.experts.3.down_proj.weight"] = t["model.layers.0.mlp.experts.down_proj"][3].clone()
    save_file(t, f"{both}/model.safetensors", metadata={"format": "pt"})
    expect_failure(capsys, both, tmp_path / "out" / "g", names=("holds its experts twice, fused",))


# --------------------------------------------------------------------------------------- the output norm's w - 1

def test_minus_one_over_every_bf16_value():
    """Megatron holds the Gated DeltaNet output norm as ``w - 1`` (fp32 arithmetic, rounded to bf16). Over all
    65280 finite bf16 values: the Megatron value is exactly ``w - 1`` wherever that is a bf16 value (checked
    with exact fractions), every ``w`` in [0.5, 256] (1153 values: a trained norm's range) is exact and comes back
    bitwise, and HF -> Megatron -> HF gives back 32895 values bitwise; the other 32385 (``|w| < 0.5`` not a
    multiple of 2^-8, -0.0, and some below -255) are rounded by ``w - 1`` (docs/formats.md)."""
    from converters.layout.megatron import hf_to_megatron, megatron_to_hf
    from models.common.weight_map import MINUS_ONE, WeightEntry
    from parallel.sharding import Replicated

    entry = WeightEntry("norm", ("norm",), (Replicated(),), "out_norm.weight", MINUS_ONE, shapes=((65536,),))
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    w = bits.view(torch.bfloat16)
    finite = torch.isfinite(w)
    m = hf_to_megatron(entry, [w], None, 0)
    assert m.dtype == torch.bfloat16
    back = megatron_to_hf(entry, m.clone(), None)[0]  # a fresh tensor: no Megatron value carried along
    same = back.view(torch.int16) == bits
    # w - 1 in float64 is exact for |w| >= 2^-45 (8 significant bits from 2^0 down); below, w - 1 needs more than
    # bf16's 8 bits: never a bf16 value (and the Megatron value is then checked with exact fractions)
    tiny = finite & (w.float().abs() < 2.0 ** -45) & (w != 0)
    x = w.double() - 1
    representable = finite & ~tiny & (x.to(torch.bfloat16).double() == x)
    exact = finite & ~tiny & (m.double() == x)
    assert not any(Fraction(mv) == Fraction(v) - 1 for v, mv in zip(w[tiny].float().tolist(), m[tiny].float().tolist()))
    assert torch.equal(exact, representable)  # exact wherever w - 1 is a bf16 value
    normal = finite & (w.float() >= 0.5) & (w.float() <= 256)
    assert int(normal.sum()) == 1153 and bool((exact & same)[normal].all())
    assert int((same & finite).sum()) == 32895 and int((~same & finite).sum()) == 32385
    small = finite & (w.float().abs() < 0.5) & (w.float() * 256 != (w.float() * 256).round())
    assert not bool((same & small).any())


# ------------------------------------------------------------------------------- real Megatron-Bridge (oracle)

BRIDGE_CASES = ("qwen3_5", "qwen3_5_moe", "qwen3_next_all_sparse")  # Bridge builds MoE on every Qwen3-Next layer
BRIDGE_WRITES = ("qwen3_5", "qwen3_next_all_sparse")


def _metadata(root: Path) -> dict:
    import pickle

    it_dir = next(p for p in sorted(root.iterdir()) if p.name.startswith(("iter_", "release")))
    return pickle.loads((it_dir / ".metadata").read_bytes()).state_dict_metadata


@pytest.fixture(scope="module")
def bridge(hf, tmp_path_factory):
    """One run of real Megatron-Bridge 0.6.2 (tests/bridge_gdn_oracle.py under .venv-bridge): it writes its own
    checkpoints of Qwen3.5 and Qwen3-Next (MTP included) and loads, strictly, what ``--to megatron-dist`` wrote
    (unpadded vocabulary, as Bridge keeps it) for each model into the model it builds from the HF directory."""
    root = tmp_path_factory.mktemp("hybrid_bridge")
    ours = {c: convert(hf[c], root / "ours" / c, to="megatron-dist", workers=1, make_vocab_size_divisible_by=1)
            for c in BRIDGE_CASES}
    jobs = [{"op": "write", "hf": hf[c], "out": str(root / "real" / c)} for c in BRIDGE_WRITES]
    jobs += [{"op": "load", "hf": hf[c], "ckpt": str(ours[c] / "release")} for c in BRIDGE_CASES]  # no iteration
    results = iter(run_bridge_oracle("bridge_gdn_oracle.py", jobs, root, timeout=600))
    return {"ours": ours, "real": {c: root / "real" / c for c in BRIDGE_WRITES},
            "writes": {c: next(results) for c in BRIDGE_WRITES}, "loads": {c: next(results) for c in BRIDGE_CASES}}


@pytest.mark.parametrize("case", BRIDGE_WRITES)
def test_real_bridge_checkpoint_to_hf_is_bitwise(hf, bridge, tmp_path, case):
    """What Megatron-Bridge wrote (per-layer keys, split in_proj/conv1d, out_norm - 1, MTP) converts to the HF
    tensors it was built from, bitwise, ``mtp.*`` included."""
    out = convert(bridge["real"][case], tmp_path / "hf", to="hf", workers=1)  # config: run_config's hf_model_id
    want = hf_tensors(hf[case])
    assert any(k.startswith("mtp.") for k in want)
    assert_same(want, hf_tensors(str(out)))


@pytest.mark.parametrize("case", BRIDGE_WRITES)
def test_pmz_writes_the_keys_bridge_writes(bridge, case):
    """``--to megatron-dist`` writes Bridge's torch_dist keys with Bridge's global shapes, and the same empty
    ``_extra_state`` items (we write common.pt where Bridge has a common_state item)."""
    ours, real = _metadata(bridge["ours"][case]), _metadata(bridge["real"][case])
    shapes = [{k: tuple(v.size) for k, v in md.items() if hasattr(v, "chunks")} for md in (ours, real)]
    assert shapes[0] == shapes[1]
    assert shapes[0] == {k: tuple(v) for k, v in bridge["writes"][case]["keys"].items() if v != "object"}
    objects = [{k for k, v in md.items() if not hasattr(v, "chunks")} for md in (ours, real)]
    assert objects[0] == objects[1] - {"common_state/shard_0_1"}


@pytest.mark.parametrize("case", BRIDGE_CASES)
def test_real_bridge_loads_what_pmz_writes(bridge, case):
    """megatron-core's strict ``dist_checkpointing.load`` (Bridge's model from the HF config, MTP built) takes
    our torch_dist checkpoint with no key missing or left over, and every weight equals, bitwise, what Bridge
    imports from the HF checkpoint itself."""
    load = bridge["loads"][case]
    assert load["loader"] == "megatron.core.dist_checkpointing.load", load
    assert load["compared"] > 40 and not (load["mismatched"] or load["missing"] or load["unexpected"]), load


def test_inspect_shows_the_layer_mix_and_verify_logits_says_only_its_own(hf, tmp_path):
    """``pmz inspect`` of a hybrid names its layer kinds (counted from the HF config here, independently);
    ``pmz verify --logits`` (a fresh interpreter, so transformers' once-only notices are not spent by other
    tests) prints its own lines and no notice of transformers' about its kernels."""
    import subprocess
    import sys

    from tests.test_convert_faults import pmz

    text = json.loads(Path(hf["qwen3_5"], "config.json").read_text())
    kinds = text["layer_types"]
    full = [i for i, kind in enumerate(kinds) if kind == FULL]
    res = pmz("inspect", hf["qwen3_5"])
    line = next((x for x in res.stdout.splitlines() if x.startswith("layers ")), "")
    assert res.returncode == 0 and f"{kinds.count(LIN)} linear-attention" in line, res.stdout + res.stderr
    assert f"+ {len(full)} full-attention (layers {', '.join(map(str, full))})" in line, line
    out = tmp_path / "legacy"
    convert(hf["qwen3_5"], out, to="megatron", tp=2)
    res = subprocess.run([sys.executable, "-m", "converters.cli", "verify", hf["qwen3_5"], str(out), "--logits"],
                         capture_output=True, text=True, timeout=300, cwd=str(Path(__file__).resolve().parents[1]))
    assert res.returncode == 0 and "max abs diff" in res.stdout, res.stdout + res.stderr
    assert "[transformers]" not in res.stderr and "falling back" not in res.stderr, res.stderr
