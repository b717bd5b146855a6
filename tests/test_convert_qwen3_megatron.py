"""Qwen3 and Qwen3-MoE Megatron checkpoints with real megatron-core (CPU, gloo) and transformers as
the references (tests/megatron_qwen3_oracle.py builds the megatron-core models).

* megatron-core, its weights mapped by hand from a transformers checkpoint, gives transformers'
  logits (Qwen3: q/k layernorm, kv_channels 24 != 64/4, tied embeddings over PP; Qwen3-MoE:
  renormalised top-k = ``moe_router_pre_softmax=False``, SequentialMLP and grouped-GEMM GroupedMLP).
* its legacy and torch_dist saves (TP2, PP2 with the tied copy, PP2xVPP2, EP2, grouped GEMM at EP2,
  TP2 and TP2xEP2) -> ``pmz convert --to hf`` -> the transformers tensors, bitwise.
* transformers' checkpoint -> ``pmz convert --to megatron / megatron-dist`` (``--moe-grouped-gemm``)
  -> megatron-core loads it strictly and gives transformers' logits.
* round trips bitwise (both paths for Qwen3), Transformer Engine's grouped layout read, bad input
  refused in one line with nothing written.
"""

from __future__ import annotations

import functools
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from converters.cli import main as pmz  # noqa: E402
from converters.engine import convert  # noqa: E402
from tests.cases import snapshot  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.megatron_qwen3_oracle import (  # noqa: E402
    Layout,
    Qwen3Spec,
    args_of,
    load_logits,
    prompt_ids,
    read_hf,
    save_from_hf,
    te_grouped_copy,
    weight1_columns_logits,
)

TOL = 1e-5
DENSE = Qwen3Spec(tie_embeddings=True, seed=3)
MOE = Qwen3Spec(moe=True, num_layers=2, seed=4)
MOE_PLAIN = Qwen3Spec(moe=True, num_layers=2, norm_topk_prob=False, seed=5)  # moe_router_pre_softmax=True
DIV = DENSE.make_vocab_size_divisible_by
SPECS = {"dense": DENSE, "moe": MOE, "moe_plain": MOE_PLAIN}
# megatron-core saves: name -> (spec, layout, fmt); 2 ranks, then 4
SAVES2 = {"d_tp2": ("dense", Layout(tp=2), "torch"), "d_pp2": ("dense", Layout(pp=2), "torch"),
          "d_pp2vpp2": ("dense", Layout(pp=2, vpp=2), "torch"), "d_tp2_dist": ("dense", Layout(tp=2), "torch_dist"),
          "m_ep2": ("moe", Layout(ep=2), "torch"), "m_ep2gg": ("moe", Layout(ep=2, grouped_gemm=True), "torch"),
          "m_tp2gg": ("moe", Layout(tp=2, grouped_gemm=True), "torch"),
          "m_ep2gg_dist": ("moe", Layout(ep=2, grouped_gemm=True), "torch_dist"),
          "p_ep2": ("moe_plain", Layout(ep=2), "torch")}
SAVES4 = {"m_tp2ep2gg": ("moe", Layout(tp=2, ep=2, grouped_gemm=True), "torch"),
          "m_ep4gg": ("moe", Layout(ep=4, grouped_gemm=True), "torch")}
# pmz conversions of the HF checkpoints, loaded by megatron-core: name -> (spec, to, options, layout, fmt)
LOADS2 = {"l_d_tp2": ("dense", "megatron", dict(tp=2), Layout(tp=2), "torch"),
          "l_d_pp2": ("dense", "megatron", dict(pp=2), Layout(pp=2), "torch"),
          "l_d_pp2vpp2": ("dense", "megatron", dict(pp=2, vpp=2), Layout(pp=2, vpp=2), "torch"),
          "l_d_dist": ("dense", "megatron-dist", dict(tp=2), Layout(pp=2), "torch_dist"),
          "l_m_ep2": ("moe", "megatron", dict(ep=2), Layout(ep=2), "torch"),
          "l_m_ep2gg": ("moe", "megatron", dict(ep=2, moe_grouped_gemm=True), Layout(ep=2, grouped_gemm=True), "torch"),
          "l_m_tp2gg": ("moe", "megatron", dict(tp=2, moe_grouped_gemm=True), Layout(tp=2, grouped_gemm=True),
                        "torch"),
          "l_m_dist": ("moe", "megatron-dist", dict(ep=2), Layout(tp=2, grouped_gemm=True), "torch_dist")}
LOADS4 = {"l_m_tp2ep2gg": ("moe", "megatron", dict(tp=2, ep=2, moe_grouped_gemm=True),
                           Layout(tp=2, ep=2, grouped_gemm=True), "torch"),
          "l_m_ep4gg": ("moe", "megatron", dict(ep=4, moe_grouped_gemm=True), Layout(ep=4, grouped_gemm=True),
                        "torch")}


def _suite(root: str, saves: dict, loads: dict) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = {}
    for name, (spec, layout, fmt) in saves.items():
        out[name] = save_from_hf(os.path.join(root, f"hf_{spec}"), os.path.join(root, name), SPECS[spec], layout, fmt)
    if dist.get_rank() == 0:  # inline conversions (daemonic ranks cannot fork workers)
        for name, (spec, to, options, _layout, _fmt) in loads.items():
            convert(os.path.join(root, f"hf_{spec}"), os.path.join(root, name), to=to, workers=1,
                    make_vocab_size_divisible_by=DIV, **options)
    dist.barrier()
    for name, (spec, _to, _options, layout, fmt) in loads.items():
        out[name] = load_logits(os.path.join(root, name), SPECS[spec], layout, fmt)
    if dist.get_world_size() == 2:
        out["weight1_columns"] = weight1_columns_logits(os.path.join(root, "hf_moe"), MOE,
                                                        Layout(ep=2, grouped_gemm=True))
    return out


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    from tests.megatron_qwen3_oracle import write_hf

    root = str(tmp_path_factory.mktemp("qwen3_megatron"))
    for i, (name, spec) in enumerate(SPECS.items()):
        write_hf(spec, os.path.join(root, f"hf_{name}"), seed=100 + i)
    out = run_distributed(2, _suite, root, SAVES2, LOADS2)[0]
    out.update(run_distributed(4, _suite, root, SAVES4, LOADS4)[0])
    return {"root": root, **out}


@torch.no_grad()
def _hf_logits(path: str, spec: Qwen3Spec) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model(input_ids=prompt_ids(spec)).logits


@functools.lru_cache(maxsize=None)
def _reference_logits(root: str, kind: str) -> torch.Tensor:
    """transformers' logits of the module's HF checkpoint ``hf_{kind}`` (written once by the ``oracle``
    fixture, read-only): computed once per module, not once per test (29 calls, 3 models)."""
    return _hf_logits(os.path.join(root, f"hf_{kind}"), SPECS[kind])


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _assert_same_hf(a_dir: str, b_dir: str) -> None:
    a, b = read_hf(a_dir), read_hf(b_dir)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


SAVED = {**SAVES2, **SAVES4}


@pytest.mark.parametrize("name", sorted(SAVED))
def test_megatron_core_gives_transformers_logits(oracle, name):
    spec = SPECS[SAVED[name][0]]
    reference = _reference_logits(oracle["root"], SAVED[name][0])
    assert _diff(oracle[name], reference) <= TOL
    other = "moe" if SAVED[name][0] == "moe_plain" else "moe_plain"
    if spec.moe:  # negative control: the other router normalisation is another model
        assert _diff(oracle[name], _reference_logits(oracle["root"], other)) > 1e-2


def _paths(kind: str) -> tuple[str, ...]:
    """PMZ_COPY_PATH values to run: Qwen3 on both paths, MoE on the torch path here (the copy path's MoE
    reading, real megatron-core sources included, is tests/test_copy_path_moe.py's)."""
    return ("1", "0") if kind == "dense" else ("0",)


def _spy_copy_path(monkeypatch) -> list[str]:
    """Record each call of the copy path's writers (the engine imports them at call time)."""
    import converters.copy_path.hf as copy_hf
    import converters.copy_path.megatron as copy_megatron

    calls: list[str] = []

    def spying(name, real):
        def spy(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return spy

    for module, name in ((copy_hf, "write_hf_by_copy"), (copy_megatron, "write_megatron_by_copy")):
        monkeypatch.setattr(module, name, spying(name, getattr(module, name)))
    return calls


def test_grouped_gemm_layout_is_megatron_cores_view(oracle):
    """Negative control of the oracle's GroupedMLP mapping: weight1 filled as column blocks (not the
    ``view(E_local, H, 2F/tp)`` megatron-core computes with) gives other logits than transformers'."""
    reference = _reference_logits(oracle["root"], "moe")
    assert _diff(oracle["m_ep2gg"], reference) <= TOL
    assert _diff(oracle["weight1_columns"], reference) > 1e-3


@pytest.mark.parametrize("name,copy_path", [(n, c) for n in sorted(SAVED) for c in _paths(SAVED[n][0])])
def test_megatron_core_checkpoint_to_hf_is_bitwise(oracle, tmp_path, monkeypatch, name, copy_path):
    kind = SAVED[name][0]
    monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
    calls = _spy_copy_path(monkeypatch)
    out = tmp_path / "hf"
    assert pmz(["convert", os.path.join(oracle["root"], name), str(out), "--to", "hf", "--quiet"]) == 0
    assert calls == (["write_hf_by_copy"] if copy_path == "1" else [])
    _assert_same_hf(os.path.join(oracle["root"], f"hf_{kind}"), str(out))
    assert _diff(_hf_logits(str(out), SPECS[kind]), oracle[name]) <= TOL


@pytest.mark.parametrize("name", sorted({**LOADS2, **LOADS4}))
def test_hf_to_megatron_loads_in_megatron_core(oracle, name):
    kind = {**LOADS2, **LOADS4}[name][0]
    reference = _reference_logits(oracle["root"], kind)
    assert _diff(oracle[name], reference) <= TOL


def test_written_args_are_megatrons(oracle):
    import argparse

    for name, (kind, _to, _options, layout, _fmt) in {"l_m_tp2ep2gg": LOADS4["l_m_tp2ep2gg"],
                                                       "l_d_pp2": LOADS2["l_d_pp2"]}.items():
        root = Path(oracle["root"], name)
        rank = "mp_rank_00_000" if layout.pp > 1 or layout.ep > 1 else "mp_rank_00"
        args = torch.load(next(root.glob(f"*/{rank}/model_optim_rng.pt")), weights_only=False)["args"]
        assert isinstance(args, argparse.Namespace)
        want = vars(args_of(SPECS[kind], layout, "torch"))
        fields = ["qk_layernorm", "kv_channels", "num_attention_heads", "num_query_groups", "add_qkv_bias",
                  "add_bias_linear", "untie_embeddings_and_output_weights", "tensor_model_parallel_size"]
        if SPECS[kind].moe:
            fields += ["num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax",
                       "moe_grouped_gemm", "moe_router_score_function", "expert_model_parallel_size",
                       "expert_tensor_parallel_size", "moe_shared_expert_intermediate_size",
                       "moe_router_topk_scaling_factor"]
        assert {f: vars(args).get(f) for f in fields} == {f: want.get(f) for f in fields}


# ---------------------------------------------------------------------------------------------- round trips


ROUND_TRIPS = [("dense", "megatron", ["--tp", "2", "--pp", "2"]), ("dense", "megatron", ["--pp", "2", "--vpp", "2"]),
               ("dense", "megatron-dist", ["--tp", "2"]),
               ("moe", "megatron", ["--ep", "2", "--moe-grouped-gemm"]),
               ("moe", "megatron", ["--tp", "2", "--pp", "2", "--ep", "2", "--moe-grouped-gemm"]),
               ("moe", "megatron", ["--ep", "4"]), ("moe", "megatron-dist", ["--tp", "2", "--ep", "2"])]


@pytest.mark.parametrize("kind,to,layout,copy_path", [(*case, c) for case in ROUND_TRIPS for c in _paths(case[0])])
def test_round_trip_is_bitwise(oracle, tmp_path, monkeypatch, kind, to, layout, copy_path):
    monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
    calls = _spy_copy_path(monkeypatch)
    src = os.path.join(oracle["root"], f"hf_{kind}")
    assert pmz(["convert", src, str(tmp_path / "mc"), "--to", to, *layout, "--quiet"]) == 0
    assert pmz(["convert", str(tmp_path / "mc"), str(tmp_path / "hf"), "--to", "hf", "--quiet"]) == 0
    assert calls == (["write_megatron_by_copy", "write_hf_by_copy"] if copy_path == "1" else [])
    _assert_same_hf(src, str(tmp_path / "hf"))


def test_megatron_reshards_between_expert_layouts(oracle, tmp_path):
    """megatron-core's grouped-GEMM EP2 checkpoint -> SequentialMLP TP2 -> grouped EP4 (a reshard keeps
    the source's GroupedMLP by default) -> torch_dist -> HF, bitwise."""
    src = os.path.join(oracle["root"], "m_ep2gg")
    steps = [("megatron", ["--tp", "2", "--ep", "1", "--no-moe-grouped-gemm"]),
             ("megatron", ["--ep", "4", "--tp", "1", "--moe-grouped-gemm"]), ("megatron", []),
             ("megatron-dist", ["--ep", "2"])]
    for i, (to, layout) in enumerate(steps):
        dst = str(tmp_path / f"s{i}")
        assert pmz(["convert", src, dst, "--to", to, *layout, "--quiet"]) == 0
        src = dst
        if i == 2:
            keys = torch.load(next(Path(dst).glob("*/mp_rank_00_003/model_optim_rng.pt")), weights_only=False)["model"]
            assert "decoder.layers.1.mlp.experts.weight1" in keys and not any("local_experts" in k for k in keys)
    assert pmz(["convert", src, str(tmp_path / "hf"), "--to", "hf", "--quiet"]) == 0
    _assert_same_hf(os.path.join(oracle["root"], "hf_moe"), str(tmp_path / "hf"))


def test_transformer_engine_grouped_experts_are_read(oracle, tmp_path):
    """TEGroupedMLP (megatron-core 0.16 ``experts.TEGroupedMLP``, TE's GroupedLinear: one ``weight{i}``
    per local expert, each SequentialMLP's shard) -- built here from megatron-core's SequentialMLP EP2
    save by renaming its expert keys, as Transformer Engine is not installed."""
    src = tmp_path / "te"
    renamed = te_grouped_copy(os.path.join(oracle["root"], "m_ep2"), src)
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight1" in renamed
    assert pmz(["convert", str(src), str(tmp_path / "hf"), "--to", "hf", "--quiet"]) == 0
    _assert_same_hf(os.path.join(oracle["root"], "hf_moe"), str(tmp_path / "hf"))


# ---------------------------------------------------------------------------------------------- bad input


def _fails(capsys, argv: list[str], dst: Path, *fragments: str) -> None:
    before = snapshot(dst.parent)
    assert pmz(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err
    assert not dst.exists() and snapshot(dst.parent) == before


def _edit_legacy(root: Path, edit) -> None:
    for f in sorted(root.glob("*/mp_rank_*/model_optim_rng.pt")):
        data = torch.load(f, weights_only=False)
        edit(f, data)
        torch.save(data, f)


@pytest.mark.parametrize("copy_path", ["1", "0"])
@pytest.mark.parametrize("damage", ["missing", "size"])
def test_bad_q_k_layernorm_in_legacy(oracle, tmp_path, capsys, monkeypatch, damage, copy_path):
    monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
    src = tmp_path / "src"
    shutil.copytree(os.path.join(oracle["root"], "d_tp2"), src)
    key = "decoder.layers.2.self_attention.k_layernorm.weight"

    def edit(f, data):
        if damage == "missing":
            del data["model"][key]
        else:
            data["model"][key] = data["model"][key][:16].clone()
    _edit_legacy(src, edit)
    fragments = ["mp_rank_00", key] + (["missing tensor"] if damage == "missing" else ["(16,)", "(24,)"])
    _fails(capsys, ["convert", str(src), str(tmp_path / "out" / "hf"), "--to", "hf"], tmp_path / "out" / "hf",
           *fragments)


@pytest.mark.parametrize("copy_path", ["1", "0"])
def test_bad_q_layernorm_in_torch_dist(oracle, tmp_path, capsys, monkeypatch, copy_path):
    monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
    src = tmp_path / "src"
    shutil.copytree(os.path.join(oracle["root"], "d_tp2_dist"), src)
    md_path = next(src.glob("*/.metadata"))
    md = pickle.loads(md_path.read_bytes())  # megatron-core's own file, in a test
    key = "decoder.layers.self_attention.q_layernorm.weight"
    md.state_dict_metadata[key].size = torch.Size([4, 32])
    md_path.write_bytes(pickle.dumps(md))
    _fails(capsys, ["convert", str(src), str(tmp_path / "hf"), "--to", "hf"], tmp_path / "hf", key, "(4, 32)",
           "(4, 24)")


@pytest.mark.parametrize("what", ["weight1", "weight2", "experts"])
def test_bad_grouped_gemm_tensors(oracle, tmp_path, capsys, what):
    src = tmp_path / "src"
    shutil.copytree(os.path.join(oracle["root"], "m_ep2gg"), src)
    key = f"decoder.layers.1.mlp.experts.{'weight2' if what == 'weight2' else 'weight1'}"

    def edit(f, data):
        if what == "experts":
            data["args"].num_experts = 8
        elif f.parent.name == "mp_rank_00_001":
            t = data["model"][key]
            data["model"][key] = t[:, :96].clone() if what == "weight1" else t[:48].clone()
    _edit_legacy(src, edit)
    if what == "experts":
        fragments = ["mlp.router.weight has shape (4, 64)", "implies (8, 64)"]
    elif what == "weight1":
        fragments = ["mp_rank_00_001", key, "(64, 96)", "(64, 128)", "2 local experts", "2*32/1"]
    else:
        fragments = ["mp_rank_00_001", key, "(48, 64)", "(64, 64)", "2 local experts", "32/1"]
    _fails(capsys, ["convert", str(src), str(tmp_path / "hf"), "--to", "hf"], tmp_path / "hf", *fragments)


def test_grouped_gemm_for_a_dense_model_is_refused(oracle, tmp_path, capsys):
    _fails(capsys, ["convert", os.path.join(oracle["root"], "hf_dense"), str(tmp_path / "mc"), "--to", "megatron",
                    "--moe-grouped-gemm"], tmp_path / "mc", "--moe-grouped-gemm", "no experts")


def test_verl_dist_ckpt_of_qwen3_moe(oracle, tmp_path):
    """verl's Megatron checkpoint of a Qwen3-MoE actor (``global_step_N/actor/dist_ckpt`` = megatron-core's
    torch_dist save without args, ``actor/huggingface/`` the HF config): megatron-core's grouped-GEMM EP2
    save laid out so -> pmz -> HF, bitwise."""
    actor = tmp_path / "verl" / "global_step_5" / "actor"
    shutil.copytree(next(Path(oracle["root"], "m_ep2gg_dist").glob("iter_*")), actor / "dist_ckpt")
    common = torch.load(actor / "dist_ckpt" / "common.pt", weights_only=False)
    del common["args"]  # verl's common state has no Megatron args
    torch.save(common, actor / "dist_ckpt" / "common.pt")
    (actor / "huggingface").mkdir()
    shutil.copy(Path(oracle["root"], "hf_moe", "config.json"), actor / "huggingface" / "config.json")
    (tmp_path / "verl" / "latest_checkpointed_iteration.txt").write_text("5")
    assert pmz(["convert", str(tmp_path / "verl"), str(tmp_path / "hf"), "--to", "hf", "--quiet"]) == 0
    _assert_same_hf(os.path.join(oracle["root"], "hf_moe"), str(tmp_path / "hf"))


@pytest.mark.parametrize("name,experts", [("m_ep2gg", "grouped_gemm"), ("m_ep2", "sequential")])
def test_inspect_names_the_expert_layout(oracle, capsys, name, experts):
    assert pmz(["inspect", os.path.join(oracle["root"], name)]) == 0
    out = capsys.readouterr().out
    assert "qwen3_moe" in out and "ep=2" in out and f"experts={experts}" in out, out


def test_expert_count_disagreeing_in_torch_dist(oracle, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(os.path.join(oracle["root"], "m_ep2gg_dist"), src)
    md_path = next(src.glob("*/.metadata"))
    md = pickle.loads(md_path.read_bytes())  # megatron-core's own file, in a test
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    md.state_dict_metadata[key].size = torch.Size([2, 8, 64, 64])
    md_path.write_bytes(pickle.dumps(md))
    _fails(capsys, ["convert", str(src), str(tmp_path / "hf"), "--to", "hf"], tmp_path / "hf", key,
           "(2, 8, 64, 64)", "(2, 4, 64, 64)")


@pytest.mark.parametrize("copy_path", ["1", "0"])
def test_bad_q_norm_in_hf_to_megatron(oracle, tmp_path, capsys, monkeypatch, copy_path):
    from safetensors.torch import save_file

    monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
    src = tmp_path / "hf_bad"
    shutil.copytree(os.path.join(oracle["root"], "hf_dense"), src)
    tensors = read_hf(str(src))
    tensors["model.layers.1.self_attn.q_norm.weight"] = tensors["model.layers.1.self_attn.q_norm.weight"][:20].clone()
    for f in src.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    _fails(capsys, ["convert", str(src), str(tmp_path / "mc"), "--to", "megatron", "--tp", "2"], tmp_path / "mc",
           "model.layers.1.self_attn.q_norm.weight", "(20,)", "(24,)")
