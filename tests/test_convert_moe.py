"""Qwen2-MoE checkpoint conversion with real megatron-core as the oracle (gloo, CPU).

* megatron-core saves Qwen2-MoE models (EP=2, TP2 x EP2; legacy and torch_dist) -> ``pmz convert
  --to hf`` -> transformers' ``Qwen2MoeForCausalLM`` gives megatron-core's logits.
* An HF checkpoint written through the oracle's own hand-written mapping (independent of
  converters/) -> ``pmz convert --to megatron / megatron-dist`` at EP=2, TP2 x EP2 and EP=4 ->
  megatron-core loads it (strictly) and gives transformers' logits; a megatron-core EP=2 checkpoint
  resharded by pmz to TP2 x EP2 and EP=4 loads too. The Megatron args written are the ones the
  oracle gives megatron-core for the same model.
* HF -> Megatron -> HF round trips bitwise over EP/TP/PP layouts and both formats, Megatron ->
  Megatron reshards with EP changes; refused router options and damaged checkpoints give one line
  and leave nothing behind.

Two spawned groups (2 ranks, then 4) do all megatron-core work; rank 0 of the 2-rank group also
runs the conversions the 4-rank group loads (inline: daemonic ranks cannot fork workers).
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from converters.cli import main as pmz  # noqa: E402
from converters.engine import convert  # noqa: E402
from tests.cases import snapshot  # noqa: E402
from tests.checkpoint_cache import cached, copy  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.megatron_moe_oracle import (  # noqa: E402
    MoeLayout,
    MoeSpec,
    load_moe_checkpoint_logits,
    moe_full_weights,
    moe_megatron_args,
    prompt_ids,
    save_moe_checkpoint,
)

PARITY_TOL = 1e-5
SPEC = MoeSpec(norm_topk_prob=False, shared_expert_intermediate_size=48, seed=41)
# renormalised top-k (megatron's moe_router_pre_softmax=False), no shared expert, 8 experts
SPEC_NORM = MoeSpec(norm_topk_prob=True, shared_expert_intermediate_size=None, num_experts=8, seed=42)
# HF -> Megatron: the oracle's HF mapping writes a missing shared expert as a zero 16-wide one (a
# real module megatron-core would not build), so the renormalised case keeps its shared expert
SPEC_NORM_HF = MoeSpec(norm_topk_prob=True, shared_expert_intermediate_size=48, num_experts=8, seed=43)
DIVISIBLE = SPEC.make_vocab_size_divisible_by  # the oracle's vocab padding unit (megatron-core's model size)
HF_SEED = 77  # the HF checkpoint converted to Megatron: weights megatron-core has never seen
EP2, TP2EP2, EP4 = MoeLayout(ep=2), MoeLayout(tp=2, ep=2), MoeLayout(ep=4)


def _hf_dir(root: str, spec: MoeSpec, seed: int) -> str:
    """An HF Qwen2-MoE directory through the oracle's hand-written mapping (tests/test_megatron_moe_oracle)."""
    from tests.test_megatron_moe_oracle import hf_from_full

    path = os.path.join(root, f"hf_{seed}")
    hf_from_full(moe_full_weights(spec, seed=seed), spec, path)
    return path


@torch.no_grad()
def _hf_logits(path: str, spec: MoeSpec) -> torch.Tensor:
    from transformers import Qwen2MoeForCausalLM

    model = Qwen2MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model(input_ids=prompt_ids(spec)).logits


@functools.lru_cache(maxsize=None)
def _reference_logits(root: str, seed: int) -> torch.Tensor:
    """transformers' logits of the ``oracle`` fixture's HF checkpoint ``hf_{seed}`` (read-only): once per module,
    not once per test (10 tests, 2 models)."""
    return _hf_logits(os.path.join(root, f"hf_{seed}"), SPEC if seed == HF_SEED else SPEC_NORM_HF)


@pytest.fixture(scope="module")
def other_model_logits(tmp_path_factory) -> dict:
    """The negative control's logits: another model (seed HF_SEED + 5) of each spec, written and run once per
    module, not once per test (6 tests, 2 models)."""
    root = tmp_path_factory.mktemp("convert_moe_other")
    return {spec: _hf_logits(_hf_dir(str(root / name), spec, HF_SEED + 5), spec)
            for name, spec in (("plain", SPEC), ("norm", SPEC_NORM))}


def world2_suite(root: str) -> dict:
    out = {}
    for name, spec in (("ep2", SPEC), ("norm_ep2", SPEC_NORM)):
        for fmt in ("torch", "torch_dist"):
            out[name, fmt] = save_moe_checkpoint(os.path.join(root, f"mc_{name}_{fmt}"), spec, EP2, fmt)["logits"]
    import torch.distributed as dist

    if dist.get_rank() == 0:  # conversions for both groups to load (inline: no worker processes here)
        for spec, seed in ((SPEC, HF_SEED), (SPEC_NORM_HF, HF_SEED + 1)):
            hf = _hf_dir(root, spec, seed)
            for to, layout in (("megatron", "ep2"), ("megatron-dist", "ep2"), ("megatron", "tp2ep2"),
                               ("megatron-dist", "tp2ep2"), ("megatron", "ep4")):
                tp, ep = (2, 2) if layout == "tp2ep2" else (1, int(layout[-1]))
                convert(hf, os.path.join(root, f"pmz_{seed}_{to}_{layout}"), to=to, tp=tp, ep=ep, workers=1,
                        make_vocab_size_divisible_by=DIVISIBLE)
        # megatron-core's own EP=2 checkpoint resharded by pmz (EP -> TP x EP, EP -> EP=4, legacy <-> dist)
        convert(os.path.join(root, "mc_ep2_torch"), os.path.join(root, "re_tp2ep2"), to="megatron", tp=2, ep=2,
                workers=1, make_vocab_size_divisible_by=DIVISIBLE)
        convert(os.path.join(root, "mc_ep2_torch_dist"), os.path.join(root, "re_ep4"), to="megatron", ep=4,
                workers=1, make_vocab_size_divisible_by=DIVISIBLE)
    dist.barrier()
    for spec, seed in ((SPEC, HF_SEED), (SPEC_NORM_HF, HF_SEED + 1)):
        for fmt, to in (("torch", "megatron"), ("torch_dist", "megatron-dist")):
            out["load", seed, to] = load_moe_checkpoint_logits(os.path.join(root, f"pmz_{seed}_{to}_ep2"), spec,
                                                               EP2, fmt)
    return out


def world4_suite(root: str) -> dict:
    out = {}
    for fmt in ("torch", "torch_dist"):
        out["mc_tp2ep2", fmt] = save_moe_checkpoint(os.path.join(root, f"mc_tp2ep2_{fmt}"), SPEC, TP2EP2,
                                                    fmt)["logits"]
    for spec, seed in ((SPEC, HF_SEED), (SPEC_NORM_HF, HF_SEED + 1)):
        for fmt, to in (("torch", "megatron"), ("torch_dist", "megatron-dist")):
            out["load_tp2ep2", seed, to] = load_moe_checkpoint_logits(
                os.path.join(root, f"pmz_{seed}_{to}_tp2ep2"), spec, TP2EP2, fmt)
        out["load_ep4", seed] = load_moe_checkpoint_logits(os.path.join(root, f"pmz_{seed}_megatron_ep4"), spec,
                                                           EP4, "torch")
    out["re_tp2ep2"] = load_moe_checkpoint_logits(os.path.join(root, "re_tp2ep2"), SPEC, TP2EP2, "torch")
    out["re_ep4"] = load_moe_checkpoint_logits(os.path.join(root, "re_ep4"), SPEC, EP4, "torch")
    return out


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("convert_moe"))
    w2 = run_distributed(2, world2_suite, root)[0]
    w4 = run_distributed(4, world4_suite, root)[0]
    return {"root": root, **w2, **w4}


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# ---------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("name,fmt", [(n, f) for n in ("ep2", "norm_ep2", "tp2ep2") for f in ("torch", "torch_dist")])
def test_megatron_core_checkpoint_to_hf_matches(oracle, other_model_logits, tmp_path, name, fmt):
    spec = SPEC_NORM if name.startswith("norm") else SPEC
    src = os.path.join(oracle["root"], f"mc_{name}_{fmt}")
    assert pmz(["convert", src, str(tmp_path / "hf"), "--to", "hf", "--quiet"]) == 0
    saved = oracle["mc_tp2ep2", fmt] if name == "tp2ep2" else oracle[name, fmt]
    ours = _hf_logits(str(tmp_path / "hf"), spec)
    assert _diff(ours, saved[..., :spec.vocab_size]) <= PARITY_TOL
    # negative control: another model's logits are far away
    assert _diff(ours, other_model_logits[spec]) > 0.1


@pytest.mark.parametrize("seed", [HF_SEED, HF_SEED + 1])
@pytest.mark.parametrize("key", ["ep2 megatron", "ep2 megatron-dist", "tp2ep2 megatron", "tp2ep2 megatron-dist",
                                 "ep4 megatron"])
def test_hf_to_megatron_loads_in_megatron_core(oracle, seed, key):
    spec = SPEC if seed == HF_SEED else SPEC_NORM_HF
    layout, to = key.split()
    loaded = {"ep2": oracle.get(("load", seed, to)), "tp2ep2": oracle.get(("load_tp2ep2", seed, to)),
              "ep4": oracle.get(("load_ep4", seed))}[layout]
    assert _diff(loaded[..., :spec.vocab_size], _reference_logits(oracle["root"], seed)) <= PARITY_TOL


@pytest.mark.parametrize("name,layout", [("re_tp2ep2", TP2EP2), ("re_ep4", EP4)])
def test_megatron_core_checkpoint_resharded_by_pmz_loads(oracle, name, layout):
    assert _diff(oracle[name], oracle["ep2", "torch"]) <= PARITY_TOL


@pytest.mark.parametrize("seed", [HF_SEED, HF_SEED + 1])
def test_written_args_are_the_ones_megatron_core_is_given(oracle, seed):
    from tests.megatron_moe_oracle import read_legacy_moe

    spec = SPEC if seed == HF_SEED else SPEC_NORM_HF
    files = read_legacy_moe(os.path.join(oracle["root"], f"pmz_{seed}_megatron_tp2ep2"))
    assert sorted(files) == [(t, 0, e) for t in range(2) for e in range(2)]
    ours = vars(files[0, 0, 0]["args"])
    want = vars(moe_megatron_args(spec, TP2EP2, "torch"))
    fields = ["num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
              "moe_shared_expert_gate", "moe_router_pre_softmax", "moe_router_score_function", "moe_layer_freq",
              "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_grouped_gemm",
              "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias", "moe_router_num_groups",
              "tensor_model_parallel_size", "num_layers", "hidden_size", "add_qkv_bias", "add_bias_linear"]
    assert {f: ours.get(f) for f in fields} == {f: want.get(f) for f in fields}


# ---------------------------------------------------------------------------------------------- round trips


def _safetensors(path: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def hf_models():
    from tests.workers_moe import write_moe_model

    return {name: cached(write_moe_model, name) for name in ("shared", "plain")}  # "shared": also tests/test_moe


ROUND_TRIPS = [("megatron", ["--ep", "2"]), ("megatron", ["--tp", "2", "--pp", "2", "--ep", "2"]),
               ("megatron", ["--pp", "2", "--ep", "4"]), ("megatron-dist", ["--ep", "2"]),
               ("megatron-dist", ["--tp", "2", "--ep", "4"])]


@pytest.mark.parametrize("name", ["shared", "plain"])
@pytest.mark.parametrize("to,layout", ROUND_TRIPS)
def test_hf_megatron_hf_round_trip_is_bitwise(hf_models, tmp_path, name, to, layout):
    src = hf_models[name]
    assert pmz(["convert", src, str(tmp_path / "mc"), "--to", to, *layout, "--quiet"]) == 0
    assert pmz(["convert", str(tmp_path / "mc"), str(tmp_path / "hf"), "--to", "hf", "--quiet"]) == 0
    _assert_same_hf(src, str(tmp_path / "hf"))


def _assert_same_hf(a_dir: str, b_dir: str) -> None:
    a, b = _safetensors(a_dir), _safetensors(b_dir)
    assert sorted(a) == sorted(b)
    for k in a:
        if a[k].numel() and k.endswith("shared_expert_gate.weight") and not any(
                v.numel() for n, v in a.items() if n.startswith(k.rsplit("_gate", 1)[0] + ".")):
            # no shared expert (width 0): megatron-core stores no gate; it comes back as zeros
            assert not b[k].any(), k
            continue
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("steps", [
    [("megatron", ["--ep", "4"]), ("megatron", ["--ep", "2"]), ("megatron", ["--tp", "2", "--ep", "1"])],
    [("megatron-dist", ["--ep", "2"]), ("megatron", ["--tp", "2", "--pp", "2", "--ep", "2"]),
     ("megatron-dist", ["--ep", "4"])],
])
def test_megatron_reshards_with_ep_changes_are_bitwise(hf_models, tmp_path, steps):
    src = hf_models["shared"]
    for i, (to, layout) in enumerate(steps):
        dst = str(tmp_path / f"step{i}")
        assert pmz(["convert", src, dst, "--to", to, *layout, "--quiet"]) == 0
        src = dst
    assert pmz(["convert", src, str(tmp_path / "hf"), "--to", "hf", "--quiet"]) == 0
    _assert_same_hf(hf_models["shared"], str(tmp_path / "hf"))


def test_reshard_keeps_source_ep_by_default(hf_models, tmp_path):
    assert pmz(["convert", hf_models["shared"], str(tmp_path / "a"), "--to", "megatron", "--ep", "2", "--quiet"]) == 0
    assert pmz(["convert", str(tmp_path / "a"), str(tmp_path / "b"), "--to", "megatron", "--quiet"]) == 0
    (folder,) = [p for p in (tmp_path / "b").iterdir() if p.name.startswith(("iter_", "release"))]
    assert sorted(p.name for p in folder.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]


# ---------------------------------------------------------------------------------------------- errors


def _fails(capsys, argv: list[str], dst: Path, *fragments: str) -> str:
    before = snapshot(dst.parent)
    assert pmz(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err
    assert not dst.exists() and snapshot(dst.parent) == before
    return err


@pytest.fixture()
def legacy_ep2(hf_models, tmp_path):
    path = tmp_path / "src"
    convert(hf_models["shared"], path, to="megatron", ep=2, workers=1)
    return path


def _edit_rank_files(root: Path, edit) -> None:
    for f in sorted(root.glob("release/mp_rank_*/model_optim_rng.pt")):
        data = torch.load(f, weights_only=False)
        edit(f, data)
        torch.save(data, f)


def test_missing_expert_shard(legacy_ep2, tmp_path, capsys):
    shutil.rmtree(legacy_ep2 / "release" / "mp_rank_00_001")
    _fails(capsys, ["convert", str(legacy_ep2), str(tmp_path / "out" / "hf"), "--to", "hf"], tmp_path / "out" / "hf",
           "missing rank folder(s) mp_rank_00_001", "ep=2")


def test_missing_expert_tensor(legacy_ep2, tmp_path, capsys):
    def drop(f, data):
        if f.parent.name == "mp_rank_00_001":
            del data["model"]["decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"]
    _edit_rank_files(legacy_ep2, drop)
    _fails(capsys, ["convert", str(legacy_ep2), str(tmp_path / "hf"), "--to", "hf"], tmp_path / "hf",
           "mp_rank_00_001", "missing tensor decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight")


def test_wrong_expert_count(legacy_ep2, tmp_path, capsys):
    def more(f, data):
        data["args"].num_experts = 16
    _edit_rank_files(legacy_ep2, more)
    (legacy_ep2 / "hf_config").rename(legacy_ep2.parent / "elsewhere")  # the args alone describe the model
    _fails(capsys, ["convert", str(legacy_ep2), str(tmp_path / "hf"), "--to", "hf"], tmp_path / "hf",
           "mlp.router.weight has shape (8, 64)", "implies (16, 64)")


def test_extra_experts_in_a_file(legacy_ep2, tmp_path, capsys):
    def extra(f, data):
        if f.parent.name == "mp_rank_00_000":
            key = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
            data["model"][key.replace(".0.linear", ".7.linear")] = data["model"][key].clone()
    _edit_rank_files(legacy_ep2, extra)
    _fails(capsys, ["convert", str(legacy_ep2), str(tmp_path / "hf"), "--to", "hf"], tmp_path / "hf",
           "unused tensor(s) decoder.layers.0.mlp.experts.local_experts.7.linear_fc1.weight", "4 local experts")


def test_mismatched_router_shape_in_hf(hf_models, tmp_path, capsys):
    from safetensors.torch import save_file

    src = tmp_path / "hf_bad"
    copy(hf_models["shared"], src)  # writable: the source is read-only in the session's checkpoint cache
    tensors = _safetensors(str(src))
    tensors["model.layers.2.mlp.gate.weight"] = tensors["model.layers.2.mlp.gate.weight"][:5].clone()
    for f in src.glob("*.safetensors"):
        f.unlink()
    (src / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    _fails(capsys, ["convert", str(src), str(tmp_path / "mc"), "--to", "megatron", "--ep", "2"], tmp_path / "mc",
           "model.layers.2.mlp.gate.weight")


def test_mismatched_router_shape_in_torch_dist(hf_models, tmp_path, capsys):
    import pickle

    convert(hf_models["shared"], tmp_path / "dist", to="megatron-dist", ep=2, workers=1)
    md_path = next((tmp_path / "dist").glob("*/.metadata"))
    with open(md_path, "rb") as f:
        md = pickle.load(f)  # our own file
    key = "decoder.layers.2.mlp.router.weight"  # per-layer keys: layer 1 is dense (mlp_only_layers)
    md.state_dict_metadata[key].size = torch.Size([6, 64])
    with open(md_path, "wb") as f:
        pickle.dump(md, f)
    _fails(capsys, ["convert", str(tmp_path / "dist"), str(tmp_path / "hf"), "--to", "hf"], tmp_path / "hf",
           key, "(6, 64)")


@pytest.mark.parametrize("option,value,reason", [
    ("moe_router_score_function", "sigmoid", "moe_router_score_function='sigmoid'"),
    ("moe_router_topk_scaling_factor", 2.5, "moe_router_topk_scaling_factor=2.5"),
    ("moe_router_num_groups", 2, "group-limited routing"),
    ("moe_router_enable_expert_bias", True, "moe_router_enable_expert_bias=True"),
    ("moe_router_load_balancing_type", "sinkhorn", "sinkhorn"),
    ("moe_expert_capacity_factor", 1.0, "token dropping"),
    ("moe_shared_expert_gate", False, "without moe_shared_expert_gate"),
])
def test_router_options_that_are_not_qwen2_moe_are_refused(legacy_ep2, tmp_path, capsys, option, value, reason):
    def set_option(f, data):
        setattr(data["args"], option, value)
    _edit_rank_files(legacy_ep2, set_option)
    shutil.rmtree(legacy_ep2 / "hf_config")
    _fails(capsys, ["convert", str(legacy_ep2), str(tmp_path / "hf"), "--to", "hf"], tmp_path / "hf",
           "not a Qwen2-MoE model", reason)


def test_pre_softmax_false_reads_as_norm_topk_prob(legacy_ep2, tmp_path):
    def flip(f, data):
        data["args"].moe_router_pre_softmax = False
    _edit_rank_files(legacy_ep2, flip)
    shutil.rmtree(legacy_ep2 / "hf_config")
    convert(legacy_ep2, tmp_path / "hf", to="hf", workers=1)
    import json

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["norm_topk_prob"] is True and config["model_type"] == "qwen2_moe"


def test_expert_tp_other_than_tp_is_refused(hf_models, tmp_path, capsys):
    src = tmp_path / "src"
    convert(hf_models["shared"], src, to="megatron", tp=2, ep=2, workers=1)

    def etp1(f, data):
        data["args"].expert_tensor_parallel_size = 1
    _edit_rank_files(src, etp1)
    _fails(capsys, ["convert", str(src), str(tmp_path / "hf"), "--to", "hf"], tmp_path / "hf",
           "expert_tensor_parallel_size=1", "tensor_model_parallel_size=2")


@pytest.mark.parametrize("argv,fragment", [
    (["--to", "megatron", "--ep", "3"], "num_experts=8 is not divisible by --ep 3"),
    (["--to", "hf", "--ep", "2"], "--ep"),
    (["--to", "megatron", "--tp", "3"], "tp=3"),
])
def test_bad_expert_layouts(hf_models, tmp_path, capsys, argv, fragment):
    dst = tmp_path / "out"
    before = snapshot(tmp_path)
    code = pmz(["convert", hf_models["shared"], str(dst), *argv])
    assert code in (1, 2)
    assert fragment in capsys.readouterr().err
    assert not dst.exists() and snapshot(tmp_path) == before


def test_ep_needs_experts(tmp_path, capsys):
    from tests.cases import copy_path_configs, write_hf_model

    src = write_hf_model(tmp_path, "dense", copy_path_configs()["qwen2"])
    capsys.readouterr()
    _fails(capsys, ["convert", str(src), str(tmp_path / "mc"), "--to", "megatron", "--ep", "2"], tmp_path / "mc",
           "--ep 2: expert parallelism needs a mixture-of-experts model")


def test_inspect_shows_experts_and_ep_layout(legacy_ep2, capsys):
    """``pmz inspect`` of an EP=2 legacy checkpoint: the expert line (from tests/workers_moe's config
    of the "shared" case) and the EP layout."""
    from tests.workers_moe import MOE_CASES

    case = MOE_CASES["shared"]
    assert pmz(["inspect", str(legacy_ep2)]) == 0
    out = capsys.readouterr().out
    sparse = sum(1 for i in range(case["num_hidden_layers"]) if i not in case["mlp_only_layers"])
    assert (f"{case['num_experts']} x ffn {case['moe_intermediate_size']}, top-{case['num_experts_per_tok']} "
            f"(softmax over all, not renormalised), shared expert {case['shared_expert_intermediate_size']}, "
            f"on {sparse} of {case['num_hidden_layers']} layers") in out
    assert "ep=2" in out
