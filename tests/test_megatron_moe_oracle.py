"""Self-tests of the megatron-core MoE oracle (tests/megatron_moe_oracle.py).

Real megatron-core on CPU (gloo) builds Qwen2-MoE-like models at EP=2, TP2 x EP2, PP2 x EP2 and
TP2 x ETP1 x EP2, saves them in Megatron-LM's legacy ``torch`` and ``torch_dist`` layouts and
reloads them. transformers' ``Qwen2MoeForCausalLM`` is built from the checkpoint files through a
megatron -> HF mapping written here by hand (independent of the project's converters) and must give
megatron-core's logits, for ``norm_topk_prob`` False (``moe_router_pre_softmax=True``) and True
(``pre_softmax=False``), with and without a shared expert. Negative controls (the other router
normalisation, experts numbered by local id, the fresh model a load starts from) show the
comparisons can fail. Two spawned groups run everything: 2 ranks, then 4 ranks.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.distributed import run_distributed  # noqa: E402
from tests.megatron_moe_oracle import (  # noqa: E402
    MoeLayout,
    MoeSpec,
    legacy_moe_dir_name,
    load_moe_checkpoint_logits,
    megatron_router,
    moe_fresh_logits,
    moe_full_weights,
    prompt_ids,
    read_legacy_moe,
    save_moe_checkpoint,
)
from tests.megatron_oracle import read_torch_dist  # noqa: E402

PARITY_TOL = 1e-5  # megatron-core vs transformers, fp32
EXACT_TOL = 1e-6  # the same layout reloaded; another layout (reduction order)

SPECS = {
    "shared_plain": MoeSpec(norm_topk_prob=False, shared_expert_intermediate_size=48, seed=21),
    "shared_norm": MoeSpec(norm_topk_prob=True, shared_expert_intermediate_size=48, seed=22),
    "noshared_plain": MoeSpec(norm_topk_prob=False, shared_expert_intermediate_size=None, seed=23),
    "noshared_norm": MoeSpec(norm_topk_prob=True, shared_expert_intermediate_size=None, num_experts=8,
                             num_layers=3, seed=24),
}
# Dense layer 1 between MoE layers (HF mlp_only_layers=[1]): torch_dist keys are not stacked.
MIXED = MoeSpec(num_layers=3, moe_layer_freq=(1, 0, 1), seed=25)
FORMATS = ("torch", "torch_dist")
EP2 = MoeLayout(ep=2)
W4_LAYOUTS = {"tp2ep2": MoeLayout(tp=2, ep=2), "pp2ep2": MoeLayout(pp=2, ep=2),
              "tp2etp1ep2": MoeLayout(tp=2, ep=2, etp=1)}
W4_SPEC = SPECS["shared_plain"]


def _control_seed(spec: MoeSpec) -> int:
    return spec.seed + 1000  # what load_moe_checkpoint_logits builds from before loading


# ----------------------------------------------------------------------------------------------
# Spawned suites
# ----------------------------------------------------------------------------------------------


def world2_suite(root: str) -> dict:
    """EP=2: every spec saved in both formats and reloaded; EP=1 of the same spec (layout
    independence); torch_dist EP=2 resharded to EP=1 by megatron; the mixed dense/MoE spec."""
    out = {}
    for name, spec in {**SPECS, "mixed": MIXED}.items():
        for fmt in FORMATS:
            path = os.path.join(root, f"{name}_ep2_{fmt}")
            saved = save_moe_checkpoint(path, spec, EP2, fmt)
            out[name, fmt, "saved"] = saved["logits"]
            out[name, fmt, "keys"] = saved["keys"]
            out[name, fmt, "reloaded"] = load_moe_checkpoint_logits(path, spec, EP2, fmt)
    spec = SPECS["shared_plain"]
    out["ep1"] = moe_fresh_logits(spec, MoeLayout(ep=1))
    out["control"] = moe_fresh_logits(spec, EP2, seed=_control_seed(spec))
    out["dist_to_ep1"] = load_moe_checkpoint_logits(os.path.join(root, "shared_plain_ep2_torch_dist"), spec,
                                                    MoeLayout(ep=1), "torch_dist")
    return out


def world4_suite(root: str) -> dict:
    """TP2 x EP2, PP2 x EP2, TP2 x ETP1 x EP2 in both formats, reloaded at the same layout; the
    TP2 x EP2 torch_dist checkpoint resharded to TP1 x EP4 by megatron."""
    out = {}
    for name, layout in W4_LAYOUTS.items():
        for fmt in FORMATS:
            path = os.path.join(root, f"{name}_{fmt}")
            saved = save_moe_checkpoint(path, W4_SPEC, layout, fmt)
            out[name, fmt, "saved"] = saved["logits"]
            out[name, fmt, "layout"] = saved["layout"]
            out[name, fmt, "file"] = saved["file"]
            out[name, fmt, "reloaded"] = load_moe_checkpoint_logits(path, W4_SPEC, layout, fmt)
    out["dist_to_ep4"] = load_moe_checkpoint_logits(os.path.join(root, "tp2ep2_torch_dist"), W4_SPEC,
                                                    MoeLayout(ep=4), "torch_dist")
    return out


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("megatron_moe_oracle")
    return str(base / "w2"), str(base / "w4")


@pytest.fixture(scope="module")
def w2(roots):
    results = run_distributed(2, world2_suite, roots[0])
    return {"root": roots[0], "ranks": results}


@pytest.fixture(scope="module")
def w4(roots):
    results = run_distributed(4, world4_suite, roots[1])
    return {"root": roots[1], "ranks": results}


# ----------------------------------------------------------------------------------------------
# megatron -> HF by hand (independent of converters/)
# ----------------------------------------------------------------------------------------------


def _split_qkv(qkv: torch.Tensor, spec: MoeSpec) -> tuple:
    """megatron's ``[q heads of group g, k_g, v_g]`` per query group -> HF q, k, v."""
    groups, d = spec.num_query_groups, spec.kv_channels
    per = spec.num_attention_heads // groups
    t = qkv.reshape(groups, (per + 2) * d, *qkv.shape[1:])
    q, k, v = t.split([per * d, d, d], dim=1)
    return tuple(x.reshape(-1, *qkv.shape[1:]) for x in (q, k, v))


def legacy_to_full(root: str) -> tuple[dict, dict]:
    """Merge a legacy checkpoint's rank files into TP=1 names with global layer numbers and global
    expert ids (``decoder.layers.{g}.mlp.experts.local_experts.{e}.…``); also returns the args."""
    files = read_legacy_moe(root)
    args = next(iter(files.values()))["args"]
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size
    n_local = args.num_experts // ep
    layers_per_stage = args.num_layers // pp
    pieces: dict[str, dict] = {}  # full name -> {shard rank: tensor}
    for (tp_rank, pp_rank, ep_rank), state in files.items():
        for name, value in state["model"].items():
            if not isinstance(value, torch.Tensor):
                continue  # _extra_state
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(pp_rank * layers_per_stage + int(parts[2]))
            is_expert = "local_experts" in parts
            if is_expert:
                at = parts.index("local_experts")
                parts[at + 1] = str(ep_rank * n_local + int(parts[at + 1]))
            # Expert shards are split over expert TP; with ETP = TP that rank is the TP rank, with
            # ETP = 1 every file holds whole experts.
            shard = (tp_rank if etp == tp else 0) if is_expert else tp_rank
            pieces.setdefault(".".join(parts), {})[shard] = value
    full = {}
    for name, shards in pieces.items():
        ordered = [shards[r] for r in sorted(shards)]
        if len(ordered) == 1 or name.endswith(("norm.weight", "router.weight", "gate_weight")):
            assert all(torch.equal(x, ordered[0]) for x in ordered), f"replicated {name} differs across ranks"
            full[name] = ordered[0]
        elif name.endswith("linear_fc1.weight"):  # [gate_r; up_r] per rank
            gates, ups = zip(*(x.chunk(2) for x in ordered))
            full[name] = torch.cat([*gates, *ups])
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            full[name] = torch.cat(ordered, dim=1)
        else:  # qkv weight/bias, embedding, output layer: dim 0
            full[name] = torch.cat(ordered, dim=0)
    return full, vars(args)


def torch_dist_to_full(root: str) -> tuple[dict, dict]:
    """A torch_dist checkpoint's global tensors under the same names as ``legacy_to_full``."""
    tensors, common = read_torch_dist(root)
    args = vars(common["args"])
    full = {}
    rename = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
              "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
    for key, value in tensors.items():
        if not key.startswith("decoder.layers."):
            full[key] = value
            continue
        rest = key[len("decoder.layers."):]
        first = rest.split(".")[0]
        if first.isdigit():  # non-homogeneous layers: one key per global layer
            layers = {int(first): value}
            rest = rest[len(first) + 1:]
        else:
            layers = dict(enumerate(value))
        rest = rename.get(rest, rest)
        for g, t in layers.items():
            if rest.startswith("mlp.experts.experts."):
                for e, te in enumerate(t):
                    full[f"decoder.layers.{g}.mlp.experts.local_experts.{e}.{rest[len('mlp.experts.experts.'):]}"] = te
            else:
                full[f"decoder.layers.{g}.{rest}"] = t
    return full, args


def hf_from_full(full: dict, spec: MoeSpec, out_dir: str, norm_topk_prob: bool | None = None,
                 local_expert_ids: int | None = None):
    """Write per-expert safetensors + config.json as a Qwen2-MoE checkpoint on disk and load it with
    ``from_pretrained`` (strictly: no missing or unexpected keys). ``local_expert_ids``: a negative
    control numbering experts ``e % local_expert_ids`` (the bug of ignoring the EP rank)."""
    from safetensors.torch import save_file
    from transformers import Qwen2MoeForCausalLM

    norm = spec.norm_topk_prob if norm_topk_prob is None else norm_topk_prob
    shared = spec.shared_expert_intermediate_size or 16  # no shared expert: zero weights
    H, V = spec.hidden_size, spec.vocab_size
    hf = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:V],
          "lm_head.weight": full["output_layer.weight"][:V],
          "model.norm.weight": full["decoder.final_layernorm.weight"]}
    mlp_only = []
    for g in range(spec.num_layers):
        m, h = f"decoder.layers.{g}.", f"model.layers.{g}."
        q, k, v = _split_qkv(full[m + "self_attention.linear_qkv.weight"], spec)
        qb, kb, vb = _split_qkv(full[m + "self_attention.linear_qkv.bias"], spec)
        hf.update({h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k, h + "self_attn.v_proj.weight": v,
                   h + "self_attn.q_proj.bias": qb, h + "self_attn.k_proj.bias": kb, h + "self_attn.v_proj.bias": vb,
                   h + "self_attn.o_proj.weight": full[m + "self_attention.linear_proj.weight"],
                   h + "input_layernorm.weight": full[m + "input_layernorm.weight"],
                   h + "post_attention_layernorm.weight": full[m + "pre_mlp_layernorm.weight"]})
        if m + "mlp.router.weight" not in full:
            mlp_only.append(g)
            gate, up = full[m + "mlp.linear_fc1.weight"].chunk(2)
            hf.update({h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up,
                       h + "mlp.down_proj.weight": full[m + "mlp.linear_fc2.weight"]})
            continue
        hf[h + "mlp.gate.weight"] = full[m + "mlp.router.weight"]
        for e in range(spec.num_experts):
            src = e % local_expert_ids if local_expert_ids else e
            gate, up = full[f"{m}mlp.experts.local_experts.{src}.linear_fc1.weight"].chunk(2)
            x = f"{h}mlp.experts.{e}."
            hf.update({x + "gate_proj.weight": gate, x + "up_proj.weight": up,
                       x + "down_proj.weight": full[f"{m}mlp.experts.local_experts.{src}.linear_fc2.weight"]})
        s = h + "mlp.shared_expert."
        if spec.has_shared_expert:
            gate, up = full[m + "mlp.shared_experts.linear_fc1.weight"].chunk(2)
            hf.update({s + "gate_proj.weight": gate, s + "up_proj.weight": up,
                       s + "down_proj.weight": full[m + "mlp.shared_experts.linear_fc2.weight"],
                       h + "mlp.shared_expert_gate.weight": full[m + "mlp.shared_experts.gate_weight"]})
        else:
            hf.update({s + "gate_proj.weight": torch.zeros(shared, H), s + "up_proj.weight": torch.zeros(shared, H),
                       s + "down_proj.weight": torch.zeros(H, shared),
                       h + "mlp.shared_expert_gate.weight": torch.zeros(1, H)})
    config = {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": V, "hidden_size": H,
        "intermediate_size": spec.ffn_hidden_size, "moe_intermediate_size": spec.moe_ffn_hidden_size,
        "shared_expert_intermediate_size": shared, "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.topk, "norm_topk_prob": norm, "decoder_sparse_step": 1,
        "mlp_only_layers": mlp_only, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_query_groups,
        "rms_norm_eps": spec.norm_epsilon, "rope_parameters": {"rope_type": "default", "rope_theta": spec.rotary_base},
        "max_position_embeddings": spec.max_position_embeddings, "tie_word_embeddings": False, "qkv_bias": True,
        "hidden_act": "silu", "torch_dtype": "float32",
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous().clone() for k, v in hf.items()}, os.path.join(out_dir, "model.safetensors"))
    model, info = Qwen2MoeForCausalLM.from_pretrained(out_dir, output_loading_info=True, dtype=torch.float32)
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
        {"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {})
    assert not problems, f"HF load of {out_dir}: {problems}"
    return model.eval()


@torch.no_grad()
def hf_logits(model, spec: MoeSpec) -> torch.Tensor:
    return model(input_ids=prompt_ids(spec)).logits


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------------------------
# Router semantics (no processes)
# ----------------------------------------------------------------------------------------------


def _hf_router(logits: torch.Tensor, topk: int, norm: bool) -> torch.Tensor:
    """transformers' own ``Qwen2MoeTopKRouter`` on given fp32 router logits (identity gate weight),
    scattered to ``[tokens, experts]`` (it computes the softmax in fp32 whatever the input dtype)."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    E = logits.shape[1]
    router = Qwen2MoeTopKRouter(Qwen2MoeConfig(hidden_size=E, num_experts=E, num_experts_per_tok=topk,
                                               norm_topk_prob=norm))
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        _, weights, idx = router(logits)
    return torch.zeros_like(logits).scatter(1, idx, weights)


@pytest.mark.parametrize("experts,topk", [(4, 1), (4, 2), (8, 2), (8, 3)])
def test_router_semantics_match_qwen2_moe(experts, topk):
    logits = torch.randn(64, experts, generator=torch.Generator().manual_seed(experts * 10 + topk), dtype=torch.float32)
    mc_pre, map_pre = megatron_router(logits, topk, pre_softmax=True)
    mc_post, map_post = megatron_router(logits, topk, pre_softmax=False)
    hf_plain, hf_norm = _hf_router(logits, topk, False), _hf_router(logits, topk, True)
    assert torch.equal(map_pre, map_post) and torch.equal(map_pre, hf_plain != 0)
    # pre_softmax=True: softmax over all experts, top-k, no renormalisation = norm_topk_prob False.
    assert (mc_pre - hf_plain).abs().max() < 1e-6
    # pre_softmax=False: top-k of logits then softmax over k = softmax, top-k, renormalise.
    assert (mc_post - hf_norm).abs().max() < 1e-6
    # The two are different models (k > 1): weights sum to 1 only when renormalised.
    assert (mc_pre - mc_post).abs().max() > 1e-2
    assert torch.allclose(mc_post.sum(1), torch.ones(64))
    assert (mc_pre.sum(1) < 1 - 1e-3).all()


def test_router_options_that_are_not_qwen2_moe():
    """Each listed megatron router option changes the routing weights of a Qwen2-MoE router."""
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    base, base_map = megatron_router(logits, 2, pre_softmax=True)
    variants = {
        "sigmoid": megatron_router(logits, 2, pre_softmax=True, score_function="sigmoid"),
        "scaling_factor": megatron_router(logits, 2, pre_softmax=True, scaling_factor=2.5),
        "group_limited": megatron_router(logits, 2, pre_softmax=True, num_groups=4, group_topk=1),
        "expert_bias": megatron_router(logits, 2, pre_softmax=True, score_function="sigmoid",
                                       expert_bias=torch.linspace(-1, 1, 8, dtype=torch.float64)),
    }
    for name, (probs, _) in variants.items():
        assert (probs - base).abs().max() > 1e-2, name


# ----------------------------------------------------------------------------------------------
# megatron-core vs transformers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_ep2_matches_transformers(w2, tmp_path, name, fmt):
    spec = SPECS[name]
    reader = legacy_to_full if fmt == "torch" else torch_dist_to_full
    full, args = reader(os.path.join(w2["root"], f"{name}_ep2_{fmt}"))
    assert args["expert_model_parallel_size"] == 2 and args["moe_router_pre_softmax"] == (not spec.norm_topk_prob)
    model = hf_from_full(full, spec, str(tmp_path / "hf"))
    megatron = w2["ranks"][0][name, fmt, "saved"]
    for r in w2["ranks"]:
        assert _diff(r[name, fmt, "saved"], megatron) <= EXACT_TOL
    assert _diff(hf_logits(model, spec), megatron) <= PARITY_TOL
    # The other normalisation from the same weights is a different model.
    other = hf_from_full(full, spec, str(tmp_path / "hf_other"), norm_topk_prob=not spec.norm_topk_prob)
    assert _diff(hf_logits(other, spec), megatron) > 1e-3


def test_expert_ids_are_global(w2, tmp_path):
    """Numbering experts by their local id (ignoring the EP rank) changes the logits."""
    spec = SPECS["shared_plain"]
    full, _ = legacy_to_full(os.path.join(w2["root"], "shared_plain_ep2_torch"))
    wrong = hf_from_full(full, spec, str(tmp_path / "hf"), local_expert_ids=spec.num_experts // 2)
    assert _diff(hf_logits(wrong, spec), w2["ranks"][0]["shared_plain", "torch", "saved"]) > 1e-3


def test_mixed_dense_and_moe_layers_match_transformers(w2, tmp_path):
    for fmt in FORMATS:
        reader = legacy_to_full if fmt == "torch" else torch_dist_to_full
        full, _ = reader(os.path.join(w2["root"], f"mixed_ep2_{fmt}"))
        model = hf_from_full(full, MIXED, str(tmp_path / fmt))
        assert model.config.mlp_only_layers == [1]
        assert _diff(hf_logits(model, MIXED), w2["ranks"][0]["mixed", fmt, "saved"]) <= PARITY_TOL


@pytest.mark.parametrize("layout", list(W4_LAYOUTS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_world4_layouts_match_transformers(w4, tmp_path, layout, fmt):
    reader = legacy_to_full if fmt == "torch" else torch_dist_to_full
    full, args = reader(os.path.join(w4["root"], f"{layout}_{fmt}"))
    lay = W4_LAYOUTS[layout]
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"],
            args["expert_model_parallel_size"], args["expert_tensor_parallel_size"]) == (
        lay.tp, lay.pp, lay.ep, lay.expert_tp)
    model = hf_from_full(full, W4_SPEC, str(tmp_path / "hf"))
    megatron = w4["ranks"][0][layout, fmt, "saved"]
    for r in w4["ranks"]:
        assert _diff(r[layout, fmt, "saved"], megatron) <= EXACT_TOL
    assert _diff(hf_logits(model, W4_SPEC), megatron) <= PARITY_TOL


# ----------------------------------------------------------------------------------------------
# Round trips through megatron-core
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*SPECS, "mixed"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_ep2_checkpoints_reload(w2, name, fmt):
    for r in w2["ranks"]:
        assert _diff(r[name, fmt, "reloaded"], r[name, fmt, "saved"]) <= EXACT_TOL


def test_reload_starts_from_another_model(w2):
    r = w2["ranks"][0]
    assert _diff(r["control"], r["shared_plain", "torch", "saved"]) > 1e-2


def test_weights_are_layout_independent(w2, w4):
    """The same spec at EP=1, EP=2, TP2xEP2, PP2xEP2, TP2xETP1xEP2 is the same model; torch_dist
    reshards EP=2 -> EP=1 and TP2xEP2 -> EP=4 in megatron."""
    ref = w2["ranks"][0]["shared_plain", "torch", "saved"]
    assert _diff(w2["ranks"][0]["ep1"], ref) <= PARITY_TOL
    assert _diff(w2["ranks"][0]["dist_to_ep1"], ref) <= PARITY_TOL
    for r in w4["ranks"]:
        assert _diff(r["dist_to_ep4"], ref) <= PARITY_TOL
        for layout in W4_LAYOUTS:
            for fmt in FORMATS:
                assert _diff(r[layout, fmt, "saved"], ref) <= PARITY_TOL
                assert _diff(r[layout, fmt, "reloaded"], r[layout, fmt, "saved"]) <= EXACT_TOL


def test_full_weights_helper_matches_megatron(w2, w4):
    """``moe_full_weights`` (no megatron) equals what megatron-core saved, merged by hand."""
    for root, name, spec in [(w2["root"], "noshared_norm_ep2_torch", SPECS["noshared_norm"]),
                             (w2["root"], "mixed_ep2_torch_dist", MIXED),
                             (w4["root"], "tp2ep2_torch", W4_SPEC), (w4["root"], "pp2ep2_torch_dist", W4_SPEC)]:
        reader = legacy_to_full if name.endswith("_torch") else torch_dist_to_full
        full, _ = reader(os.path.join(root, name))
        expected = moe_full_weights(spec)
        vocab = {"embedding.word_embeddings.weight", "output_layer.weight"}
        assert set(full) == set(expected), set(full) ^ set(expected)
        for key, value in expected.items():
            got = full[key][: spec.vocab_size] if key in vocab else full[key]
            assert torch.equal(got, value), key


# ----------------------------------------------------------------------------------------------
# The layout facts the module docstring states
# ----------------------------------------------------------------------------------------------


def test_legacy_folders_writers_and_contents(w2, w4):
    it = "iter_0000010"
    assert sorted(os.listdir(os.path.join(w2["root"], "shared_plain_ep2_torch", it))) == [
        "mp_rank_00_000", "mp_rank_00_001"]
    assert sorted(os.listdir(os.path.join(w4["root"], "tp2ep2_torch", it))) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    assert sorted(os.listdir(os.path.join(w4["root"], "pp2ep2_torch", it))) == [
        "mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"]
    # TP2 x ETP1 x EP2 on 4 ranks: rank r has tp = r % 2, ep = r % 2 (order tp-cp-ep-dp-pp), so only
    # (tp, ep) = (0, 0) and (1, 1) exist; each file holds whole experts (ETP = 1).
    assert sorted(os.listdir(os.path.join(w4["root"], "tp2etp1ep2_torch", it))) == ["mp_rank_00_000", "mp_rank_01_001"]
    positions = [(r["tp2etp1ep2", "torch", "layout"]["tp"], r["tp2etp1ep2", "torch", "layout"]["ep"])
                 for r in w4["ranks"]]
    assert positions == [(0, 0), (1, 1), (0, 0), (1, 1)]
    assert [r["tp2etp1ep2", "torch", "file"] is not None for r in w4["ranks"]] == [True, True, False, False]
    etp1 = read_legacy_moe(os.path.join(w4["root"], "tp2etp1ep2_torch"))
    f = W4_SPEC.moe_ffn_hidden_size
    expert0 = etp1[(1, 0, 1)]["model"]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert expert0.shape == (2 * f, 64)
    assert etp1[(1, 0, 1)]["model"]["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] == 64  # TP half
    # TP2 x EP2: experts split over expert TP (= TP), [gate_r; up_r]; non-expert parts on every EP rank.
    files = read_legacy_moe(os.path.join(w4["root"], "tp2ep2_torch"))
    full = moe_full_weights(W4_SPEC)
    s = W4_SPEC.shared_expert_intermediate_size
    for (tp_rank, _, ep_rank), state in files.items():
        model = state["model"]
        assert state["args"].expert_tensor_parallel_size == 2 and state["checkpoint_version"] == 3.0
        for i in range(2):
            e = ep_rank * 2 + i
            gate, up = full[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"].chunk(2)
            got = model[f"decoder.layers.1.mlp.experts.local_experts.{i}.linear_fc1.weight"]
            assert torch.equal(got, torch.cat([gate.chunk(2)[tp_rank], up.chunk(2)[tp_rank]]))
            fc2 = full[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2.weight"]
            assert torch.equal(model[f"decoder.layers.1.mlp.experts.local_experts.{i}.linear_fc2.weight"],
                               fc2.chunk(2, dim=1)[tp_rank])
        assert not any(".local_experts.2." in k for k in model)
        assert model["decoder.layers.0.mlp.router.weight"].shape == (4, 64)
        assert model["decoder.layers.0.mlp.shared_experts.gate_weight"].shape == (1, 64)
        assert model["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"].shape == (2 * s // 2, 64)
        assert model["decoder.layers.0.mlp.shared_experts.linear_fc2.weight"].shape == (64, s // 2)
        assert torch.equal(model["decoder.layers.0.pre_mlp_layernorm.weight"],
                           full["decoder.layers.0.pre_mlp_layernorm.weight"])
    for tp_rank in range(2):  # the EP ranks' copies of non-expert tensors are identical
        a, b = files[(tp_rank, 0, 0)]["model"], files[(tp_rank, 0, 1)]["model"]
        for k in a:
            if "local_experts" not in k and isinstance(a[k], torch.Tensor):
                assert torch.equal(a[k], b[k]), k
    # PP2 x EP2: layer numbers local to the stage, the same local expert ids on both EP ranks.
    pp_files = read_legacy_moe(os.path.join(w4["root"], "pp2ep2_torch"))
    assert "embedding.word_embeddings.weight" in pp_files[(0, 0, 1)]["model"]
    assert "output_layer.weight" in pp_files[(0, 1, 0)]["model"]
    assert {k.split(".")[2] for k in pp_files[(0, 1, 1)]["model"] if k.startswith("decoder.layers.")} == {"0"}


def test_legacy_dir_name_rule():
    assert legacy_moe_dir_name(0, 0, 1, pp=1, ep=2) == "mp_rank_00_001"
    assert legacy_moe_dir_name(1, 1, 0, pp=2, ep=1) == "mp_rank_01_001"
    assert legacy_moe_dir_name(1, 1, 3, pp=2, ep=4) == "mp_rank_01_001_003"
    assert legacy_moe_dir_name(3, 0, 0, pp=1, ep=1) == "mp_rank_03"


def test_torch_dist_keys_shapes_and_chunks(w2, w4):
    import torch.distributed.checkpoint as dcp

    spec = W4_SPEC
    L, E, F, H, S = spec.num_layers, spec.num_experts, spec.moe_ffn_hidden_size, spec.hidden_size, 48
    expected = {
        "decoder.layers.mlp.router.weight": (L, E, H),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (L, E, 2 * F, H),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (L, E, H, F),
        "decoder.layers.mlp.shared_experts.linear_fc1.weight": (L, 2 * S, H),
        "decoder.layers.mlp.shared_experts.linear_fc2.weight": (L, H, S),
        "decoder.layers.mlp.shared_experts.gate_weight": (L, 1, H),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, H),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, H),
    }

    def chunks(root, key):
        md = dcp.FileSystemReader(os.path.join(root, "iter_0000010")).read_metadata().state_dict_metadata
        return md, sorted((tuple(c.offsets), tuple(c.sizes)) for c in md[key].chunks)

    tp2ep2 = os.path.join(w4["root"], "tp2ep2_torch_dist")
    for root in (os.path.join(w2["root"], "shared_plain_ep2_torch_dist"), tp2ep2):
        md, _ = chunks(root, "decoder.layers.mlp.router.weight")
        for key, shape in expected.items():
            assert tuple(md[key].size) == shape, key
        assert not any("local_experts" in k or "pre_mlp_layernorm" in k for k in md)
    # TP2 x EP2 (ETP = 2): per (layer, expert) a gate chunk and an up chunk per ETP rank.
    _, fc1 = chunks(tp2ep2, "decoder.layers.mlp.experts.experts.linear_fc1.weight")
    assert fc1 == sorted(((g, e, row, 0), (1, 1, F // 2, H)) for g in range(L) for e in range(E)
                         for row in (0, F // 2, F, F + F // 2))
    _, fc2 = chunks(tp2ep2, "decoder.layers.mlp.experts.experts.linear_fc2.weight")
    assert fc2 == sorted(((g, e, 0, c), (1, 1, H, F // 2)) for g in range(L) for e in range(E) for c in (0, F // 2))
    _, fc1_etp1 = chunks(os.path.join(w4["root"], "tp2etp1ep2_torch_dist"),
                         "decoder.layers.mlp.experts.experts.linear_fc1.weight")
    assert fc1_etp1 == sorted(((g, e, row, 0), (1, 1, F, H)) for g in range(L) for e in range(E) for row in (0, F))
    # Mixed dense/MoE layers: one key per global layer, no stacking.
    md, _ = chunks(os.path.join(w2["root"], "mixed_ep2_torch_dist"), "decoder.layers.0.mlp.router.weight")
    assert tuple(md["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"].size) == (
        MIXED.num_experts, 2 * MIXED.moe_ffn_hidden_size, H)
    assert tuple(md["decoder.layers.1.mlp.linear_fc1.weight"].size) == (2 * MIXED.ffn_hidden_size, H)
    assert "decoder.layers.1.mlp.router.weight" not in md and "decoder.layers.2.mlp.router.weight" in md
