"""Self-tests of the megatron-core oracle (tests/megatron_oracle.py) that converter tests rely on.

Real megatron-core on CPU (gloo) saves random Llama/Qwen2-like GQA models in Megatron-LM's legacy
``torch`` and ``torch_dist`` layouts and reloads them at the same or another TP/PP/VPP layout; the
fixed prompt's logits must survive. Negative controls (the freshly built model a load starts from,
a load with the wrong architecture) show a load that does nothing or loads the wrong thing fails.
The layout checks pin the Megatron facts converters build on (DESIGN.md, "Megatron checkpoint
layouts"). Two spawned groups run everything: 2 ranks, then 4 ranks.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.distributed import run_distributed  # noqa: E402
from tests.megatron_oracle import (  # noqa: E402
    ITERATION,
    OracleSpec,
    fresh_logits,
    load_checkpoint_logits,
    read_legacy,
    read_torch_dist,
    save_random_checkpoint,
)

EXACT_TOL = 1e-6  # same layout: the same fp32 computation on the same weights
RESHARD_TOL = 1e-5  # another layout: TP reductions sum in another order

# head_dim differs from hidden / heads in both; GQA with 2 query groups.
LLAMA = OracleSpec(arch="llama", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, kv_channels=32, vocab_size=100, tie_embeddings=False, seed=11)
QWEN2 = OracleSpec(arch="qwen2", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8,
                   num_query_groups=2, kv_channels=16, vocab_size=100, tie_embeddings=True, seed=12)
# 8 layers so each of the 2x2 virtual chunks holds 2 (local numbers 0, 1).
QWEN2_DEEP = OracleSpec(arch="qwen2", num_layers=8, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8,
                        num_query_groups=2, kv_channels=16, vocab_size=100, tie_embeddings=True, seed=13)
SPECS = {"llama": LLAMA, "qwen2": QWEN2}
FORMATS = ("torch", "torch_dist")


def _control_seed(spec: OracleSpec) -> int:
    return spec.seed + 1000  # what load_checkpoint_logits initializes from before loading


def world2_suite(root: str) -> dict:
    """TP=2 round trips for both archs and formats, PP=2 x VPP=2 (legacy and torch_dist), a wrong load."""
    out = {}
    for name, spec in SPECS.items():
        for fmt in FORMATS:
            path = os.path.join(root, f"{name}_tp2_{fmt}")
            out[name, fmt, "saved"] = save_random_checkpoint(path, spec, 2, 1, None, fmt)
            out[name, fmt, "reloaded"] = load_checkpoint_logits(path, spec, 2, 1, None, fmt)
        out[name, "control"] = fresh_logits(spec, 2, 1, None, seed=_control_seed(spec))
    for fmt in FORMATS:
        path = os.path.join(root, f"qwen2_deep_pp2_vpp2_{fmt}")
        out["vpp", fmt, "saved"] = save_random_checkpoint(path, QWEN2_DEEP, 1, 2, 2, fmt)
    out["vpp", "torch", "reloaded"] = load_checkpoint_logits(os.path.join(root, "qwen2_deep_pp2_vpp2_torch"),
                                                            QWEN2_DEEP, 1, 2, 2, "torch")
    out["vpp", "torch_dist", "reloaded_tp2"] = load_checkpoint_logits(
        os.path.join(root, "qwen2_deep_pp2_vpp2_torch_dist"), QWEN2_DEEP, 2, 1, None, "torch_dist")
    out["vpp", "control"] = fresh_logits(QWEN2_DEEP, 1, 2, 2, seed=_control_seed(QWEN2_DEEP))
    # The llama checkpoints have no QKV bias: loading them as qwen2 must fail in both formats.
    for fmt in FORMATS:
        qwen2_as_llama = OracleSpec(**{**QWEN2.to_dict(), **{k: v for k, v in LLAMA.to_dict().items() if k != "arch"}})
        try:
            load_checkpoint_logits(os.path.join(root, f"llama_tp2_{fmt}"), qwen2_as_llama, 2, 1, None, fmt)
            out["wrong_arch", fmt] = None
        except KeyError as exc:
            out["wrong_arch", fmt] = str(exc)
    return out


def world4_suite(root: str) -> dict:
    """TP=2 x PP=2: torch_dist resharded to TP=1 PP=1 by megatron itself; tied legacy round trip."""
    out = {}
    for name, spec in SPECS.items():
        path = os.path.join(root, f"{name}_tp2pp2_torch_dist")
        out[name, "torch_dist", "saved"] = save_random_checkpoint(path, spec, 2, 2, None, "torch_dist")
        out[name, "torch_dist", "reloaded_tp1pp1"] = load_checkpoint_logits(path, spec, 1, 1, None, "torch_dist")
    path = os.path.join(root, "qwen2_tp2pp2_torch")
    out["qwen2", "torch", "saved"] = save_random_checkpoint(path, QWEN2, 2, 2, None, "torch")
    out["qwen2", "torch", "reloaded"] = load_checkpoint_logits(path, QWEN2, 2, 2, None, "torch")
    out["qwen2", "control_tp2pp2"] = fresh_logits(QWEN2, 2, 2, None, seed=_control_seed(QWEN2))
    return out


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    return str(tmp_path_factory.mktemp("mcore_w2")), str(tmp_path_factory.mktemp("mcore_w4"))


@pytest.fixture(scope="module")
def w2(roots):
    results = run_distributed(2, world2_suite, roots[0])
    return results, roots[0]


@pytest.fixture(scope="module")
def w4(roots):
    results = run_distributed(4, world4_suite, roots[1])
    return results, roots[1]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _assert_meaningful(logits: torch.Tensor, control: torch.Tensor, spec: OracleSpec) -> None:
    """The logits are real-vocab sized, not degenerate, and far from the unloaded starting model."""
    assert logits.shape == (2, 12, spec.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.std().item() > 0.05
    assert _diff(logits, control) > 0.05


# ----------------------------------------------------------------------------------------------
# Round trips
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_tp2_round_trip_same_layout(w2, name, fmt):
    results, _ = w2
    saved = results[0][name, fmt, "saved"]["logits"]
    _assert_meaningful(saved, results[0][name, "control"], SPECS[name])
    for rank_result in results:  # every rank returns the same logits
        assert _diff(rank_result[name, fmt, "reloaded"], saved) <= EXACT_TOL


@pytest.mark.parametrize("name", sorted(SPECS))
def test_formats_share_the_model(w2, name):
    """save_random_checkpoint is deterministic: both formats hold the same weights."""
    results, _ = w2
    assert _diff(results[0][name, "torch", "saved"]["logits"], results[0][name, "torch_dist", "saved"]["logits"]) == 0


def test_vpp_legacy_round_trip(w2):
    results, _ = w2
    saved = results[0]["vpp", "torch", "saved"]["logits"]
    _assert_meaningful(saved, results[0]["vpp", "control"], QWEN2_DEEP)
    assert _diff(results[0]["vpp", "torch", "reloaded"], saved) <= EXACT_TOL


def test_vpp_torch_dist_reshards_to_tp2(w2):
    results, _ = w2
    saved = results[0]["vpp", "torch_dist", "saved"]["logits"]
    assert _diff(saved, results[0]["vpp", "torch", "saved"]["logits"]) == 0
    assert _diff(results[0]["vpp", "torch_dist", "reloaded_tp2"], saved) <= RESHARD_TOL


@pytest.mark.parametrize("name", sorted(SPECS))
def test_torch_dist_tp2pp2_reshards_to_tp1pp1(w4, name):
    results, _ = w4
    saved = results[0][name, "torch_dist", "saved"]["logits"]
    assert saved.std().item() > 0.05
    for rank_result in results:
        assert _diff(rank_result[name, "torch_dist", "reloaded_tp1pp1"], saved) <= RESHARD_TOL


def test_tied_legacy_tp2pp2_round_trip(w4):
    results, _ = w4
    saved = results[0]["qwen2", "torch", "saved"]["logits"]
    _assert_meaningful(saved, results[0]["qwen2", "control_tp2pp2"], QWEN2)
    assert _diff(results[3]["qwen2", "torch", "reloaded"], saved) <= EXACT_TOL


@pytest.mark.parametrize("fmt", FORMATS)
def test_wrong_architecture_fails_to_load(w2, fmt):
    message = w2[0][0]["wrong_arch", fmt]
    assert message is not None and "linear_qkv.bias" in message


# ----------------------------------------------------------------------------------------------
# Layout facts converters rely on
# ----------------------------------------------------------------------------------------------


def test_legacy_files_and_args(w2):
    _, root = w2
    path = os.path.join(root, "llama_tp2_torch")
    with open(os.path.join(path, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == str(ITERATION)
    assert sorted(os.listdir(os.path.join(path, "iter_0000010"))) == ["mp_rank_00", "mp_rank_01"]
    ckpt = read_legacy(path)
    assert sorted(ckpt) == [(0, 0), (1, 0)]
    state = ckpt[0, 0]
    assert sorted(state) == ["args", "checkpoint_version", "iteration", "model"]
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == ITERATION
    args = state["args"]
    assert (args.padded_vocab_size, args.vocab_size, args.make_vocab_size_divisible_by) == (128, 100, 16)
    assert (args.num_query_groups, args.group_query_attention, args.kv_channels) == (2, True, 32)
    assert args.untie_embeddings_and_output_weights and args.swiglu and not args.add_qkv_bias
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 1)
    assert args.virtual_pipeline_model_parallel_size is None


def test_legacy_key_names_and_shapes(w2):
    """Rank 0 of the TP=2 llama: local-spec names, per-rank shards, ``_extra_state`` = None."""
    _, root = w2
    model = read_legacy(os.path.join(root, "llama_tp2_torch"))[0, 0]["model"]
    h, kv, ffn, nh, ng = 64, 32, 128, 4, 2
    expected = {
        "embedding.word_embeddings.weight": (128 // 2, h),
        "decoder.final_layernorm.weight": (h,),
        "output_layer.weight": (128 // 2, h),
    }
    for i in range(4):
        p = f"decoder.layers.{i}."
        expected |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attention.linear_qkv.weight": ((nh + 2 * ng) * kv // 2, h),
            p + "self_attention.linear_proj.weight": (h, nh * kv // 2),
            p + "pre_mlp_layernorm.weight": (h,),
            p + "mlp.linear_fc1.weight": (2 * ffn // 2, h),
            p + "mlp.linear_fc2.weight": (h, ffn // 2),
        }
    tensors = {k: tuple(v.shape) for k, v in model.items() if isinstance(v, torch.Tensor)}
    assert tensors == expected
    extra = {k: v for k, v in model.items() if not isinstance(v, torch.Tensor)}
    assert all(k.endswith("._extra_state") and v is None for k, v in extra.items())
    assert "output_layer._extra_state" in extra and "decoder.layers.0.mlp.linear_fc1._extra_state" in extra


def test_legacy_vpp_chunks_use_local_layer_numbers(w2):
    _, root = w2
    path = os.path.join(root, "qwen2_deep_pp2_vpp2_torch")
    assert sorted(os.listdir(os.path.join(path, "iter_0000010"))) == ["mp_rank_00_000", "mp_rank_00_001"]
    ckpt = read_legacy(path)
    for state in ckpt.values():
        assert {"model0", "model1"} <= set(state) and "model" not in state
        assert state["args"].virtual_pipeline_model_parallel_size == 2
        for chunk in ("model0", "model1"):
            layers = {k.split(".")[2] for k in state[chunk] if k.startswith("decoder.layers.")}
            assert layers == {"0", "1"}
    assert "embedding.word_embeddings.weight" in ckpt[0, 0]["model0"]
    assert "embedding.word_embeddings.weight" not in ckpt[0, 0]["model1"]
    last = ckpt[0, 1]["model1"]  # global stage 3 holds the head
    assert "decoder.final_layernorm.weight" in last and "output_layer.weight" in last
    # Tied and PP > 1: the last stage's copy of the embedding, identical after Megatron's init all-reduce.
    assert torch.equal(last["output_layer.weight"], ckpt[0, 0]["model0"]["embedding.word_embeddings.weight"])
    # Global layer order: pp0/model0 = layers 0-1, pp1/model0 = 2-3, pp0/model1 = 4-5, pp1/model1 = 6-7.
    tensors, _ = read_torch_dist(os.path.join(root, "qwen2_deep_pp2_vpp2_torch_dist"))
    stacked = tensors["decoder.layers.self_attention.linear_qkv.weight"]
    for (pp_rank, chunk), first in (((0, "model0"), 0), ((1, "model0"), 2), ((0, "model1"), 4), ((1, "model1"), 6)):
        for local in (0, 1):
            got = ckpt[0, pp_rank][chunk][f"decoder.layers.{local}.self_attention.linear_qkv.weight"]
            assert torch.equal(got, stacked[first + local])


def test_tied_legacy_pp2_last_stage_holds_output_copy(w4):
    _, root = w4
    ckpt = read_legacy(os.path.join(root, "qwen2_tp2pp2_torch"))
    assert sorted(ckpt) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for tp_rank in (0, 1):
        first, last = ckpt[tp_rank, 0]["model"], ckpt[tp_rank, 1]["model"]
        assert "output_layer.weight" not in first and "embedding.word_embeddings.weight" not in last
        assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
        assert {k.split(".")[2] for k in last if k.startswith("decoder.layers.")} == {"0", "1"}


def test_torch_dist_files_common_and_keys(w2):
    import json

    _, root = w2
    path = os.path.join(root, "llama_tp2_torch_dist")
    it_dir = os.path.join(path, "iter_0000010")
    files = set(os.listdir(it_dir))
    assert {"metadata.json", ".metadata", "common.pt"} <= files
    assert any(f.startswith("__0_") and f.endswith(".distcp") for f in files)
    with open(os.path.join(it_dir, "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == "torch_dist"
    tensors, common = read_torch_dist(path)
    assert sorted(common) == ["args", "checkpoint_version", "iteration"]
    assert common["args"].ckpt_format == "torch_dist" and common["iteration"] == ITERATION
    L, h, kv, ffn, nh, ng = 4, 64, 32, 128, 4, 2
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        "embedding.word_embeddings.weight": (128, h),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, h),  # local input_layernorm
        "decoder.layers.self_attention.linear_qkv.weight": (L, (nh + 2 * ng) * kv, h),
        "decoder.layers.self_attention.linear_proj.weight": (L, h, nh * kv),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, h),  # local pre_mlp_layernorm
        "decoder.layers.mlp.linear_fc1.weight": (L, 2 * ffn, h),
        "decoder.layers.mlp.linear_fc2.weight": (L, h, ffn),
        "decoder.final_layernorm.weight": (h,),
        "output_layer.weight": (128, h),
    }
    # Tied: only the embedding is stored.
    tied, _ = read_torch_dist(os.path.join(root, "qwen2_tp2_torch_dist"))
    assert "output_layer.weight" not in tied and "decoder.layers.self_attention.linear_qkv.bias" in tied


@pytest.mark.parametrize("name", sorted(SPECS))
def test_torch_dist_global_tensors_match_legacy_shards(w2, name):
    """The same model in both formats: torch_dist holds the global tensors the legacy TP shards make.

    QKV (weight and bias), embedding and output: TP shards concatenated on dim 0; linear_proj and
    linear_fc2: on dim 1; gated linear_fc1: each shard is [gate_r; up_r], the global tensor is
    [gate_0; gate_1; up_0; up_1].
    """
    _, root = w2
    legacy = read_legacy(os.path.join(root, f"{name}_tp2_torch"))
    shards = [legacy[r, 0]["model"] for r in (0, 1)]
    tensors, _ = read_torch_dist(os.path.join(root, f"{name}_tp2_torch_dist"))
    spec = SPECS[name]

    def cat(key, dim):
        return torch.cat([s[key] for s in shards], dim=dim)

    checked = set()

    def check(global_key, expected):
        assert torch.equal(tensors[global_key], expected), global_key
        checked.add(global_key)

    check("embedding.word_embeddings.weight", cat("embedding.word_embeddings.weight", 0))
    if not spec.tie_embeddings:
        check("output_layer.weight", cat("output_layer.weight", 0))
    check("decoder.final_layernorm.weight", shards[0]["decoder.final_layernorm.weight"])
    per_layer = {
        "self_attention.linear_qkv.layer_norm_weight": lambda p: shards[0][p + "input_layernorm.weight"],
        "mlp.linear_fc1.layer_norm_weight": lambda p: shards[0][p + "pre_mlp_layernorm.weight"],
        "self_attention.linear_qkv.weight": lambda p: cat(p + "self_attention.linear_qkv.weight", 0),
        "self_attention.linear_proj.weight": lambda p: cat(p + "self_attention.linear_proj.weight", 1),
        "mlp.linear_fc2.weight": lambda p: cat(p + "mlp.linear_fc2.weight", 1),
        "mlp.linear_fc1.weight": lambda p: torch.cat(
            [s[p + "mlp.linear_fc1.weight"].chunk(2)[0] for s in shards]
            + [s[p + "mlp.linear_fc1.weight"].chunk(2)[1] for s in shards]),
    }
    if spec.add_qkv_bias:
        per_layer["self_attention.linear_qkv.bias"] = lambda p: cat(p + "self_attention.linear_qkv.bias", 0)
    for suffix, expected in per_layer.items():
        check(f"decoder.layers.{suffix}",
              torch.stack([expected(f"decoder.layers.{i}.") for i in range(spec.num_layers)]))
    assert checked == set(tensors)  # every stored tensor accounted for


def test_saved_key_descriptions(w2, w4):
    """What each rank saw while saving: legacy names per chunk; torch_dist names map local module
    names to global stacked keys with the layer as a leading offset, and tied PP>1 output layers to
    the embedding key as a non-main replica (so it is not stored)."""
    results2, _ = w2
    vpp_keys = results2[0]["vpp", "torch_dist", "saved"]["keys"]  # pp rank 0
    assert set(vpp_keys) == {"model0", "model1"}
    kind, key, global_shape, _, offset, _ = vpp_keys["model1"]["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert (kind, key, global_shape[0], offset[0]) == (
        "ShardedTensor", "decoder.layers.self_attention.linear_qkv.weight", 8, 5)
    assert vpp_keys["model0"]["decoder.layers.0.mlp.linear_fc1.weight"][0] == "ShardedTensorFactory"
    results4, _ = w4
    last = next(r for r in results4 if r["qwen2", "torch_dist", "saved"]["pp_rank"] == 1)
    kind, key, _, _, _, replica = last["qwen2", "torch_dist", "saved"]["keys"]["model"]["output_layer.weight"]
    assert (kind, key) == ("ShardedTensor", "embedding.word_embeddings.weight") and replica[0] != 0
