"""The Megatron-Bridge oracle for the Gated DeltaNet hybrids (``tests/bridge_gdn_oracle.py``, real
Megatron-Bridge 0.6.2 under ``.venv-bridge``, one subprocess for the whole module) checked against
independent references before other tests lean on it:

  * its model's fp32 logits equal transformers' (this venv, same HF directory) for tiny Qwen3.5 (tied,
    MTP), Qwen3.5-MoE (MTP with per-expert tensors) and Qwen3-Next (MTP), 70 tokens (two delta-rule chunks);
  * the checkpoint it writes (``save_megatron_model``) loads back bitwise through Bridge's own loader and
    through megatron-core's strict ``dist_checkpointing.load`` (no run_config.yaml);
  * Bridge's own export of that checkpoint gives back every HF tensor bitwise, ``mtp.*`` included (so the
    MTP block was imported, not left at its initial values);
  * the checkpoint's tensors, read here with ``torch.distributed.checkpoint``, are the HF tensors in the
    layout the oracle's docstring states (per-layer keys, in_proj/conv1d split into named parts, Qwen3-Next's
    head-group interleaving undone, ``out_norm`` = HF norm - 1, MTP under ``transformer_layer``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.bridge_run import run_bridge_oracle
from tests.workers_qwen3_5 import write_model

CASES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
SEQ = 70  # past one 64-token chunk of the delta rule


def _configs() -> dict:
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    lin, full = "linear_attention", "full_attention"
    common = dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=128)
    moe = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts_per_tok=2,
               tie_word_embeddings=False)
    # the MTP block is built from the last decoder layer's spec: every pattern ends on full attention
    return {
        "qwen3_5": Qwen3_5TextConfig(**common, intermediate_size=96, layer_types=[lin, lin, lin, full],
                                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                     linear_value_head_dim=24, tie_word_embeddings=True),
        "qwen3_5_moe": Qwen3_5MoeTextConfig(**common, **moe, num_experts=8, layer_types=[lin, full, lin, full],
                                            linear_num_key_heads=2, linear_num_value_heads=4,
                                            linear_key_head_dim=16, linear_value_head_dim=24),
        "qwen3_next": Qwen3NextConfig(**common, **moe, num_experts=4, intermediate_size=96,
                                      layer_types=[full, lin, lin, full], linear_num_key_heads=4,
                                      linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16),
    }


def _add_mtp(path: Path, seed: int) -> None:
    """Random ``mtp.*`` tensors as real Qwen3.5 / Qwen3-Next checkpoints carry them (one MTP layer of full
    attention; MoE experts per expert) and ``mtp_num_hidden_layers: 1`` in config.json (transformers'
    CausalLM classes neither build nor load them)."""
    cfg = json.loads((path / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    hidden, hd, heads, kv = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape, std=0.08):
        return torch.randn(*shape, generator=gen) * std

    t = {"mtp.fc.weight": rand(hidden, 2 * hidden)}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "layers.0.input_layernorm",
                 "layers.0.post_attention_layernorm"):
        t[f"mtp.{name}.weight"] = rand(hidden, std=0.1)
    a, m = "mtp.layers.0.self_attn.", "mtp.layers.0.mlp."
    t.update({a + "q_proj.weight": rand(2 * heads * hd, hidden), a + "k_proj.weight": rand(kv * hd, hidden),
              a + "v_proj.weight": rand(kv * hd, hidden), a + "o_proj.weight": rand(hidden, heads * hd),
              a + "q_norm.weight": rand(hd, std=0.1), a + "k_norm.weight": rand(hd, std=0.1)})
    if "num_experts" in cfg:
        ffn, shared = cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
        t[m + "gate.weight"] = rand(cfg["num_experts"], hidden)
        for e in range(cfg["num_experts"]):
            t.update({f"{m}experts.{e}.gate_proj.weight": rand(ffn, hidden),
                      f"{m}experts.{e}.up_proj.weight": rand(ffn, hidden),
                      f"{m}experts.{e}.down_proj.weight": rand(hidden, ffn)})
        t.update({m + "shared_expert.gate_proj.weight": rand(shared, hidden),
                  m + "shared_expert.up_proj.weight": rand(shared, hidden),
                  m + "shared_expert.down_proj.weight": rand(hidden, shared),
                  m + "shared_expert_gate.weight": rand(1, hidden)})
    else:
        ffn = cfg["intermediate_size"]
        t.update({m + "gate_proj.weight": rand(ffn, hidden), m + "up_proj.weight": rand(ffn, hidden),
                  m + "down_proj.weight": rand(hidden, ffn)})
    weights = path / "model.safetensors"
    save_file({**load_file(weights), **t}, weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}, indent=2))


def _hf_tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _read_torch_dist(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint, read with torch.distributed.checkpoint (no process group)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(next(ckpt.glob("iter_*"))))
    meta = reader.read_metadata().state_dict_metadata
    out = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in meta.items()
           if isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        load(out, storage_reader=reader, no_dist=True)
    return out


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """Tiny HF checkpoints with MTP; one oracle run: Bridge writes each, loads it back (its loader, and
    strict dist_checkpointing without run_config.yaml), computes logits from it and exports it to HF; one
    more write without MTP."""
    root = tmp_path_factory.mktemp("bridge_gdn")
    hf = {}
    for i, (case, config) in enumerate(_configs().items()):
        hf[case] = Path(write_model(root / "hf", case, config, seed=i))
        _add_mtp(hf[case], seed=100 + i)
    ids = torch.randint(0, 101, (2, SEQ), generator=torch.Generator().manual_seed(0)).tolist()
    jobs = []
    for case in CASES:
        ckpt, common = str(root / "real" / case), {"hf": str(hf[case])}
        jobs += [{"op": "write", **common, "out": ckpt},
                 {"op": "load", **common, "ckpt": ckpt},
                 {"op": "load", **common, "ckpt": ckpt, "via": "dist_checkpointing"},
                 {"op": "logits", **common, "ckpt": ckpt, "ids": ids},
                 {"op": "export", **common, "ckpt": ckpt, "out": str(root / "export" / case)}]
    jobs.append({"op": "write", "hf": str(hf["qwen3_5"]), "out": str(root / "real" / "no_mtp"), "mtp": False})
    results = run_bridge_oracle("bridge_gdn_oracle.py", jobs, root)
    per_case = {case: dict(zip(("write", "load", "load_dcp", "logits", "export"), results[5 * i:5 * i + 5]))
                for i, case in enumerate(CASES)}
    return {"root": root, "hf": hf, "ids": ids, "cases": per_case, "no_mtp": results[-1]}


@pytest.mark.parametrize("case", CASES)
def test_bridge_logits_equal_transformers(oracle, case):
    """The Bridge model loaded from its own checkpoint gives transformers' fp32 logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(oracle["hf"][case], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor(oracle["ids"])).logits
    got = torch.tensor(oracle["cases"][case]["logits"]["logits"])
    assert got.shape == ref.shape
    diff = (got - ref).abs().max().item()
    assert diff < 2e-5, f"{case}: max |logit diff| {diff:.3g} vs transformers (logits up to {ref.abs().max():.3g})"


@pytest.mark.parametrize("loader", ["load", "load_dcp"])
@pytest.mark.parametrize("case", CASES)
def test_write_load_round_trip_is_bitwise(oracle, case, loader):
    result = oracle["cases"][case][loader]
    expected = ("megatron.bridge.models.gpt_provider.GPTModelProvider" if loader == "load"
                else "megatron.core.dist_checkpointing.load")
    assert result["loader"] == expected
    assert result["compared"] > 40 and not (result["mismatched"] or result["missing"] or result["unexpected"]), result


@pytest.mark.parametrize("case", CASES)
def test_bridge_export_gives_back_every_hf_tensor(oracle, case):
    """Bridge's megatron->HF export of its checkpoint is the original HF checkpoint, bitwise, MTP included."""
    original, exported = _hf_tensors(oracle["hf"][case]), _hf_tensors(oracle["cases"][case]["export"]["out"])
    assert sorted(exported) == sorted(original)
    assert any(k.startswith("mtp.") for k in original)
    bad = [k for k, v in original.items() if not (exported[k].dtype == v.dtype and torch.equal(exported[k], v))]
    assert not bad, bad


def _gdn_parts(case: str, cfg, hf: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """The HF tensors of one linear-attention layer split into Bridge's in_proj parts (query, key, value, z,
    beta, alpha: every head of a part together) and conv1d parts (query, key, value)."""
    p = f"model.layers.{layer}.linear_attn."
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    if case == "qwen3_next":  # per key-head group: [q_g, k_g, v_g, z_g] and [b_g, a_g]
        per = hv // hk
        qkvz = hf[p + "in_proj_qkvz.weight"].view(hk, 2 * dk + 2 * per * dv, -1)
        q, k, v, z = (x.reshape(-1, qkvz.shape[-1]) for x in qkvz.split([dk, dk, per * dv, per * dv], dim=1))
        ba = hf[p + "in_proj_ba.weight"].view(hk, 2 * per, -1)
        b, a = (x.reshape(-1, ba.shape[-1]) for x in ba.split([per, per], dim=1))
    else:
        q, k, v = hf[p + "in_proj_qkv.weight"].split([hk * dk, hk * dk, hv * dv])
        z, b, a = hf[p + "in_proj_z.weight"], hf[p + "in_proj_b.weight"], hf[p + "in_proj_a.weight"]
    conv = hf[p + "conv1d.weight"].split([hk * dk, hk * dk, hv * dv])
    parts = {f"in_proj.weight.{n}": t for n, t in zip(("query", "key", "value", "z", "beta", "alpha"),
                                                       (q, k, v, z, b, a))}
    parts.update({f"conv1d.weight.{n}": t for n, t in zip(("query", "key", "value"), conv)})
    return parts


def _gated_qkv(cfg, hf: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    """Megatron's ``linear_qkv`` of a gated-attention layer from HF's q_proj (per head [query, gate]), k_proj,
    v_proj: per KV group, the queries of its heads, then their gates, then its key, then its value."""
    heads, groups, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = hf[p + "q_proj.weight"].view(groups, heads // groups, 2, hd, -1)
    k, v = hf[p + "k_proj.weight"].view(groups, hd, -1), hf[p + "v_proj.weight"].view(groups, hd, -1)
    return torch.cat([q[:, :, 0].flatten(1, 2), q[:, :, 1].flatten(1, 2), k, v], dim=1).flatten(0, 1)


@pytest.mark.parametrize("case", CASES)
def test_bridge_checkpoint_layout(oracle, case):
    """What Bridge wrote, read with torch.distributed.checkpoint, against the HF tensors it came from."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(oracle["hf"][case])
    hf = _hf_tensors(oracle["hf"][case])
    ckpt = _read_torch_dist(oracle["root"] / "real" / case)
    keys = oracle["cases"][case]["write"]["keys"]
    assert set(ckpt) == {k for k, v in keys.items() if v != "object"}
    assert not any(k.startswith("decoder.layers.self_attention") for k in keys), "layers are not stacked"
    assert ("output_layer.weight" in ckpt) != cfg.tie_word_embeddings
    assert torch.equal(ckpt["embedding.word_embeddings.weight"], hf["model.embed_tokens.weight"])
    assert torch.equal(ckpt["decoder.final_layernorm.weight"], hf["model.norm.weight"])
    for layer, kind in enumerate(cfg.layer_types):
        d, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        if kind == "linear_attention":
            s = d + "self_attention."
            for name, tensor in _gdn_parts(case, cfg, hf, layer).items():
                assert torch.equal(ckpt[s + name], tensor), (case, s + name)
            assert torch.equal(ckpt[s + "in_proj.layer_norm_weight"], hf[h + "input_layernorm.weight"])
            assert torch.equal(ckpt[s + "out_norm.weight"], hf[h + "linear_attn.norm.weight"] - 1)
            for name in ("A_log", "dt_bias"):
                assert torch.equal(ckpt[s + name], hf[h + f"linear_attn.{name}"])
            assert torch.equal(ckpt[s + "out_proj.weight"], hf[h + "linear_attn.out_proj.weight"])
        else:
            s = d + "self_attention."
            assert torch.equal(ckpt[s + "linear_qkv.layer_norm_weight"], hf[h + "input_layernorm.weight"])
            assert torch.equal(ckpt[s + "q_layernorm.weight"], hf[h + "self_attn.q_norm.weight"])
            assert torch.equal(ckpt[s + "linear_proj.weight"], hf[h + "self_attn.o_proj.weight"])
            assert torch.equal(ckpt[s + "linear_qkv.weight"], _gated_qkv(cfg, hf, h + "self_attn."))
        if case == "qwen3_5":
            gate_up = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
            assert torch.equal(ckpt[d + "mlp.linear_fc1.weight"], gate_up)
            assert torch.equal(ckpt[d + "mlp.linear_fc1.layer_norm_weight"], hf[h + "post_attention_layernorm.weight"])
        else:
            experts = torch.stack([torch.cat([hf[f"{h}mlp.experts.{e}.gate_proj.weight"],
                                              hf[f"{h}mlp.experts.{e}.up_proj.weight"]])
                                   for e in range(cfg.num_experts)]) if f"{h}mlp.experts.0.gate_proj.weight" in hf \
                else hf[h + "mlp.experts.gate_up_proj"]
            assert torch.equal(ckpt[d + "mlp.experts.experts.linear_fc1.weight"], experts)
            assert torch.equal(ckpt[d + "pre_mlp_layernorm.weight"], hf[h + "post_attention_layernorm.weight"])
            assert torch.equal(ckpt[d + "mlp.router.weight"], hf[h + "mlp.gate.weight"])
            assert torch.equal(ckpt[d + "mlp.shared_experts.gate_weight"], hf[h + "mlp.shared_expert_gate.weight"])
    mtp = "mtp.layers.0."
    assert torch.equal(ckpt[mtp + "eh_proj.weight"], hf["mtp.fc.weight"])
    assert torch.equal(ckpt[mtp + "enorm.weight"], hf["mtp.pre_fc_norm_embedding.weight"])
    assert torch.equal(ckpt[mtp + "transformer_layer.self_attention.linear_proj.weight"],
                       hf["mtp.layers.0.self_attn.o_proj.weight"])


def test_write_without_mtp(oracle):
    """``"mtp": false`` builds (and writes) the model without its MTP block, even from a checkpoint with one."""
    keys = oracle["no_mtp"]["keys"]
    assert not any(k.startswith("mtp.") for k in keys)
    assert set(keys) == {k for k in oracle["cases"]["qwen3_5"]["write"]["keys"] if not k.startswith("mtp.")}
