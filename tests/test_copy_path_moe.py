"""Mixture-of-experts conversions on the copy path (converters/copy_path/, no torch), against the torch
path (``PMZ_COPY_PATH=0``) and against the HF model each checkpoint was made from.

* Sources written by pmz (the torch path's Megatron writers) from transformers' Qwen2-MoE (with a
  shared expert and a dense layer: torch_dist keys per layer; without one: zero-size tensors and a
  gate Megatron does not store) and Qwen3-MoE (q/k norms, no shared expert): legacy EP2, TP2 x EP2,
  TP2 x PP2 x EP2, PP2 x VPP2 x EP4, TP2 x EP4, Transformer Engine's grouped names, torch_dist EP2
  and TP2 x EP4, grouped-GEMM ``GroupedMLP`` (transposed expert blocks), and the HF directories
  themselves (HF -> HF).
* Sources written by real megatron-core (tests/megatron_qwen3_oracle.py, tests/megatron_moe_oracle.py):
  Qwen3-MoE TP2 x EP2 legacy and torch_dist (stacked experts ``[L, E, 2F, H]``), Qwen2-MoE with a
  shared expert and a dense middle layer (torch_dist per global layer), TP2 x EP2, both formats.
* Every one converts to HF on the copy path (the engine's ``_convert_by_copy`` returns True) into
  the torch path's files byte for byte, whose tensors are the reference HF model's.
* Megatron targets (legacy at TP/PP/VPP/EP, SequentialMLP or GroupedMLP experts, and torch_dist) from HF
  and Megatron sources: the copy path writes the torch path's file set; every file that is not a
  ``torch.save`` archive byte for byte, every archive the same objects (keys in order, args, tensor bytes,
  torch_dist metadata: ``torch.save`` itself writes a random serialization id, so no two of its runs are
  byte-identical); without importing torch; HF -> Megatron -> HF gives the HF tensors back bitwise;
  a bad layout gives the torch path's one-line error with nothing written.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from converters.cli import main as pmz
from converters.engine import convert
from tests.cases import convert_to_hf_in_fresh_python, snapshot
from tests.megatron_qwen3_oracle import te_grouped_copy

ROOT = Path(__file__).resolve().parents[1]

# name -> (HF model, pmz target, layout options)
PMZ_SOURCES = {
    "shared-ep2": ("shared", "megatron", dict(ep=2)),
    "shared-tp2ep2": ("shared", "megatron", dict(tp=2, ep=2)),
    "shared-tp2pp2ep2": ("shared", "megatron", dict(tp=2, pp=2, ep=2)),
    "shared-pp2vpp2ep4": ("shared", "megatron", dict(pp=2, vpp=2, ep=4)),
    "shared-dist-tp2ep2": ("shared", "megatron-dist", dict(tp=2, ep=2)),
    "plain-tp2ep4": ("plain", "megatron", dict(tp=2, ep=4)),
    "plain-dist-ep4": ("plain", "megatron-dist", dict(ep=4)),
    "qwen3-tp2ep2": ("qwen3", "megatron", dict(tp=2, ep=2)),
    "qwen3-tp2pp2ep2": ("qwen3", "megatron", dict(tp=2, pp=2, ep=2)),
    "qwen3-dist-tp2ep2": ("qwen3", "megatron-dist", dict(tp=2, ep=2)),
}


def write_qwen3_moe(path: Path, seed: int = 5) -> str:
    """A random transformers Qwen3-MoE (4 layers, 8 experts, head_dim 24 != 64/4), norms randomized too."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64,
                            tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.08)
    model.save_pretrained(str(path))
    return str(path)


def te_grouped(src: Path, dst: Path) -> None:
    """Transformer Engine's ``TEGroupedMLP`` names made from a SequentialMLP legacy checkpoint
    (``tests/megatron_qwen3_oracle.te_grouped_copy``: Transformer Engine is not installed)."""
    te_grouped_copy(src, dst)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.workers_moe import write_moe_model

    root = tmp_path_factory.mktemp("moe_models")
    hf = {"shared": write_moe_model(root, "shared", seed=1), "plain": write_moe_model(root, "plain", seed=2),
          "qwen3": write_qwen3_moe(root / "qwen3")}
    sources = {f"{name}-hf": (name, Path(path)) for name, path in hf.items()}
    for name, (model, to, layout) in PMZ_SOURCES.items():
        dst = root / name
        convert(hf[model], dst, to=to, workers=1, **layout)
        sources[name] = (model, dst)
    te_grouped(root / "qwen3-tp2ep2", root / "qwen3-te-tp2ep2")
    sources["qwen3-te-tp2ep2"] = ("qwen3", root / "qwen3-te-tp2ep2")
    return {"hf": hf, "sources": sources}


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_tensors(reference: Path, ours: Path) -> None:
    """``ours`` holds ``reference``'s tensors bitwise (a gate of a width-0 shared expert, which
    Megatron does not store, comes back as zeros)."""
    a, b = _tensors(reference), _tensors(ours)
    assert sorted(a) == sorted(b)
    for k in a:
        if k.endswith("shared_expert_gate.weight") and not b[k].any() and not a[k.replace(
                "shared_expert_gate.weight", "shared_expert.down_proj.weight")].numel():
            continue
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def both_paths(src: Path, out: Path, taken: list[bool], monkeypatch, **options) -> tuple[Path, Path]:
    """``src`` -> HF by the copy path (asserted taken) and by the torch path; the two file sets are
    identical byte for byte. Returns both output folders."""
    fast, slow = out / "copy", out / "torch"
    convert(src, fast, to="hf", workers=2, **options)
    assert taken[-1] is True, f"{src}: the copy path was not taken"
    monkeypatch.setenv("PMZ_COPY_PATH", "0")
    convert(src, slow, to="hf", workers=2, **options)
    monkeypatch.delenv("PMZ_COPY_PATH")
    assert taken[-1] is False
    a, b = _files(fast), _files(slow)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], f"{src}: {name} differs between the copy and the torch path"
    return fast, slow


@pytest.mark.parametrize("name", ["shared-hf", "plain-hf", "qwen3-hf", *PMZ_SOURCES, "qwen3-te-tp2ep2"])
def test_moe_to_hf_on_the_copy_path_is_the_torch_paths_bytes(models, tmp_path, monkeypatch, paths_taken, name):
    model, src = models["sources"][name]
    shard = "30KB" if name in ("shared-tp2ep2", "qwen3-dist-tp2ep2", "shared-hf") else "5GB"
    fast, _ = both_paths(src, tmp_path, paths_taken, monkeypatch, max_shard_size=shard)
    if shard == "30KB":
        assert len(list(fast.glob("*.safetensors"))) > 1
    assert_same_tensors(Path(models["hf"][model]), fast)


def test_grouped_gemm_sources_on_the_copy_path(models, tmp_path, monkeypatch, paths_taken):
    """GroupedMLP's weight1/weight2 hold each expert transposed: the copy path reads them as transposed
    blocks (``ops.Transposed``) and writes the torch path's HF files, which give the model back."""
    src = tmp_path / "gg"
    convert(models["hf"]["qwen3"], src, to="megatron", tp=2, ep=2, moe_grouped_gemm=True, workers=1)
    fast, _ = both_paths(src, tmp_path / "out", paths_taken, monkeypatch)
    assert_same_tensors(Path(models["hf"]["qwen3"]), fast)


def test_cli_moe_conversion_to_hf_never_imports_torch(models, tmp_path):
    src = models["sources"]["qwen3-tp2ep2"][1]
    assert convert_to_hf_in_fresh_python(src, tmp_path / "out", tmp_path) == "NO-TORCH 0"
    assert_same_tensors(Path(models["hf"]["qwen3"]), tmp_path / "out")


def _dist_without_args(src: Path, dst: Path) -> None:
    """The torch_dist folder of pmz's save ``src`` at ``dst`` with no Megatron args in common.pt (what
    verl and Megatron-Bridge save: the model is described by an HF config found beside it)."""
    (it,) = [p for p in src.iterdir() if p.is_dir() and p.name.startswith(("iter_", "release"))]
    shutil.copytree(it, dst)
    common = torch.load(dst / "common.pt", weights_only=False)
    del common["args"]
    torch.save(common, dst / "common.pt")


@pytest.mark.parametrize("layout", ["verl", "bridge"])
def test_verl_and_bridge_torch_dist_on_the_copy_path(models, tmp_path, monkeypatch, paths_taken, layout):
    """verl's ``global_step_N/actor/dist_ckpt`` (HF config in ``actor/huggingface``) and
    Megatron-Bridge's ``iter_N/`` (``run_config.yaml`` naming the HF model) of a Qwen3-MoE TP2 x EP2
    torch_dist save: located as the torch path locates them, converted on the copy path."""
    hf = Path(models["hf"]["qwen3"])
    root = tmp_path / layout
    if layout == "verl":
        actor = root / "global_step_5" / "actor"
        _dist_without_args(models["sources"]["qwen3-dist-tp2ep2"][1], actor / "dist_ckpt")
        (actor / "huggingface").mkdir()
        shutil.copy(hf / "config.json", actor / "huggingface" / "config.json")
    else:
        it = root / "iter_0000005"
        _dist_without_args(models["sources"]["qwen3-dist-tp2ep2"][1], it)
        (it / "run_config.yaml").write_text(f"model:\n  hf_model_id: {hf}\n")
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    fast, _ = both_paths(root, tmp_path / "out", paths_taken, monkeypatch)
    assert_same_tensors(hf, fast)


def test_plan_reads_experts_from_their_ep_rank_and_the_rest_from_ep_rank_0(models):
    """Each expert's bytes come from the rank folder of its EP rank (``mp_rank_TT_EEE``, local id
    ``e % (E/ep)``), attention and router from EP rank 0's copy."""
    from converters.copy_path.sources import open_raw_source

    source = open_raw_source(str(models["sources"]["shared-tp2ep2"][1]))
    folders = {name: {Path(op.path).parent.name for op in p.ops if hasattr(op, "path")} |
               {Path(part[0]).parent.name for op in p.ops for part in getattr(op, "parts", ())}
               for name, p in source.planned.items()}
    assert folders["model.layers.0.mlp.experts.1.gate_proj.weight"] == {"mp_rank_00_000", "mp_rank_01_000"}
    assert folders["model.layers.0.mlp.experts.6.down_proj.weight"] == {"mp_rank_00_001", "mp_rank_01_001"}
    assert folders["model.layers.2.mlp.gate.weight"] == {"mp_rank_00_000"}
    assert folders["model.layers.2.self_attn.q_proj.weight"] == {"mp_rank_00_000", "mp_rank_01_000"}


# ---------------------------------------------------------------------------------------------- real megatron-core

def _megatron_suite(root: str) -> dict:
    """4 ranks: megatron-core's TP2 x EP2 saves of Qwen3-MoE (from the HF model) and of a Qwen2-MoE
    with a shared expert and a dense middle layer (its own weights), legacy and torch_dist."""
    from tests.megatron_moe_oracle import MoeLayout, MoeSpec, save_moe_checkpoint
    from tests.megatron_qwen3_oracle import Layout, Qwen3Spec, save_from_hf

    torch.set_num_threads(1)
    spec = Qwen3Spec(moe=True, num_layers=2, num_experts=4, seed=9)
    mixed = MoeSpec(num_layers=3, moe_layer_freq=(1, 0, 1), seed=25)
    for fmt in ("torch", "torch_dist"):
        save_from_hf(os.path.join(root, "hf_qwen3"), os.path.join(root, f"q3_{fmt}"), spec, Layout(tp=2, ep=2), fmt)
        save_moe_checkpoint(os.path.join(root, f"q2_{fmt}"), mixed, MoeLayout(tp=2, ep=2), fmt)
    return {}


@pytest.fixture(scope="module")
def megatron_core(tmp_path_factory):
    pytest.importorskip("megatron.core")
    from tests.distributed import run_distributed
    from tests.megatron_moe_oracle import MoeSpec, moe_full_weights
    from tests.megatron_qwen3_oracle import Qwen3Spec, write_hf
    from tests.test_megatron_moe_oracle import hf_from_full

    root = tmp_path_factory.mktemp("moe_megatron_core")
    write_hf(Qwen3Spec(moe=True, num_layers=2, num_experts=4, seed=9), str(root / "hf_qwen3"), seed=31)
    mixed = MoeSpec(num_layers=3, moe_layer_freq=(1, 0, 1), seed=25)
    hf_from_full(moe_full_weights(mixed), mixed, str(root / "hf_qwen2"))  # the weights megatron-core was given
    run_distributed(4, _megatron_suite, str(root))
    return root


@pytest.mark.parametrize("name", ["q3_torch", "q3_torch_dist", "q2_torch", "q2_torch_dist"])
def test_megatron_core_moe_checkpoints_to_hf(megatron_core, tmp_path, monkeypatch, paths_taken, name):
    fast, _ = both_paths(megatron_core / name, tmp_path, paths_taken, monkeypatch)
    assert_same_tensors(megatron_core / f"hf_{'qwen3' if name.startswith('q3') else 'qwen2'}", fast)


# ---------------------------------------------------------------------------------------------- bad input


def _error(capsys, src: Path, dst: Path) -> str:
    before = snapshot(dst.parent)
    assert pmz(["convert", str(src), str(dst), "--to", "hf"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not dst.exists() and snapshot(dst.parent) == before
    return err


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size * 2 // 3)


def _more_experts(src: Path) -> None:
    for f in src.glob("*/mp_rank_*/model_optim_rng.pt"):
        data = torch.load(f, weights_only=False)
        data["args"].num_experts = 16
        torch.save(data, f)
    shutil.rmtree(src / "hf_config")  # the args alone describe the model


def _dist_expert_count(src: Path) -> None:
    import pickle

    md_path = next(src.glob("*/.metadata"))
    md = pickle.loads(md_path.read_bytes())  # our own file, in a test
    key = "decoder.layers.2.mlp.experts.experts.linear_fc1.weight"  # per layer: layer 1 is dense
    md.state_dict_metadata[key].size = torch.Size([16, 64, 64])
    md_path.write_bytes(pickle.dumps(md))


DAMAGE = {  # name -> (source, damage, fragments of the error)
    "truncated expert rank file": ("shared-tp2ep2", lambda s: _truncate(next(s.glob("*/mp_rank_01_001/*.pt"))),
                                   ["mp_rank_01_001"]),
    "expert count in the args": ("shared-tp2ep2", _more_experts, ["mlp.router.weight", "(16, 64)"]),
    "truncated torch_dist data file": ("shared-dist-tp2ep2", lambda s: _truncate(next(s.glob("*/__1_0.distcp"))),
                                       ["truncated data file __1_0.distcp"]),
    "expert count in torch_dist": ("shared-dist-tp2ep2", _dist_expert_count,
                                   ["decoder.layers.2.mlp.experts.experts.linear_fc1.weight", "(16, 64, 64)",
                                    "(8, 64, 64)"]),
    "truncated HF expert shard": ("qwen3-hf", lambda s: _truncate(s / "model.safetensors"), ["model.safetensors"]),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_moe_sources_fail_as_on_the_torch_path(models, tmp_path, capsys, monkeypatch, damage):
    name, edit, fragments = DAMAGE[damage]
    src = tmp_path / "src"
    shutil.copytree(models["sources"][name][1], src)
    edit(src)
    errors = {}
    for copy_path in ("1", "0"):
        monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
        errors[copy_path] = _error(capsys, src, tmp_path / "out" / "hf")
    assert errors["1"] == errors["0"]
    for fragment in fragments:
        assert fragment in errors["1"], errors["1"]


# ---------------------------------------------------------------------------------------------- row buffers


@pytest.mark.parametrize("iov_max,budget", [(1024, 1 << 15), (7, 1 << 15), (2, 1 << 15), (1024, 300)])
def test_row_views_kept_per_grid_are_the_rows_of_each_block(monkeypatch, iov_max, budget):
    """``RowViews`` (the per-row buffers of an interleaved read, made once per grid of the buffer and
    sliced per block, as an expert's ``down_proj`` under TP reads them) gives exactly ``row_spans``
    of each block: the same bytes of the buffer, cut into ``preadv`` calls of at most IOV_MAX
    buffers whose byte counts are right, with and without gaps between rows."""
    import random

    import converters.copy_path.vectored as cio

    monkeypatch.setattr(cio, "_IOV_MAX", iov_max)
    monkeypatch.setattr(cio.RowViews, "BUDGET", budget)  # 300: most grids too fine to keep, the rest evicted
    rng = random.Random(7)
    raw = bytearray(rng.getrandbits(8) for _ in range(20_000))
    buf = memoryview(raw)
    views = cio.RowViews(buf)
    cio._DISCARD[:64] = bytes(range(64))
    for _ in range(300):
        width = rng.randint(2, 400)
        col = rng.randrange(width)
        nbytes = rng.randint(1, width - col)
        gap = rng.choice([0, 0, rng.randint(1, 60)])
        start = rng.randrange(len(buf) - width)
        k = rng.randint(1, (len(buf) - start) // width)
        want = cio.row_spans(buf[start:start + k * width], k, width, col, nbytes, gap)
        calls = views(start, k, width, col, nbytes, gap)
        assert all(len(bufs) <= iov_max and n == sum(map(len, bufs)) for bufs, n in calls)
        got = [b for bufs, _ in calls for b in bufs]
        assert [bytes(b) for b in got] == [bytes(b) for b in want]
        # the row buffers are the block's own memory, not copies
        got[0][:1] = b"\xff"
        assert raw[start + col] == 0xff
        raw[start + col] = rng.getrandbits(8)
    assert views.kept == sum(len(spans) for _, spans in views.cache.values()) <= views.BUDGET


def test_row_views_grid_reaches_only_as_far_as_the_blocks_read():
    """A grid is made as far down the buffer as the blocks read so far (doubling), not over the whole buffer:
    a 4-row tensor in a 2 MiB buffer of 128-byte rows makes 4 views, not 16K (making them, and the garbage
    collections they set off in a process holding torch, once took longer than the copy)."""
    import converters.copy_path.vectored as cio

    buf = memoryview(bytearray(2 << 20))
    views = cio.RowViews(buf)
    views(0, 4, 128, 0, 128, 0)
    assert [rows for rows, _ in views.cache.values()] == [4] and views.kept == 4
    views(100 * 128, 8, 128, 0, 128, 0)  # further down the same grid: extended to reach row 108
    assert [rows for rows, _ in views.cache.values()] == [108] and views.kept == 108
    views(0, 2, 128, 0, 128, 0)  # within it: nothing made
    assert views.kept == 108


# ---------------------------------------------------------------------------------------------- Megatron targets

# (source, target format, options): HF -> legacy / torch_dist at TP/PP/VPP/EP, Megatron -> Megatron reshards
# (EP and TP changed, legacy <-> torch_dist, Transformer Engine's names read), grouped-GEMM targets and sources
MEGATRON_TARGETS = {
    "qwen3-hf legacy tp2 ep2": ("qwen3-hf", "megatron", dict(tp=2, ep=2)),
    "shared-hf legacy tp1 pp2 ep2": ("shared-hf", "megatron", dict(pp=2, ep=2)),
    "plain-hf legacy tp2 pp2 vpp2 ep2": ("plain-hf", "megatron", dict(tp=2, pp=2, vpp=2, ep=2)),
    "qwen3-hf dist tp2 ep2": ("qwen3-hf", "megatron-dist", dict(tp=2, ep=2)),
    "shared-hf dist ep4 (per-layer keys)": ("shared-hf", "megatron-dist", dict(ep=4)),
    "shared-tp2ep2 legacy tp1 ep4": ("shared-tp2ep2", "megatron", dict(tp=1, ep=4)),
    "shared-tp2pp2ep2 kept": ("shared-tp2pp2ep2", "megatron", dict()),
    "qwen3-dist-tp2ep2 legacy tp1 ep1": ("qwen3-dist-tp2ep2", "megatron", dict(tp=1, ep=1)),
    "shared-pp2vpp2ep4 dist": ("shared-pp2vpp2ep4", "megatron-dist", dict()),
    "qwen3-te-tp2ep2 legacy ep4": ("qwen3-te-tp2ep2", "megatron", dict(ep=4)),
    "qwen3-hf grouped tp2 ep2": ("qwen3-hf", "megatron", dict(tp=2, ep=2, moe_grouped_gemm=True)),
    "shared-tp2ep2 grouped pp2 ep4": ("shared-tp2ep2", "megatron", dict(pp=2, ep=4, moe_grouped_gemm=True)),
    "plain-hf dist grouped ep2": ("plain-hf", "megatron-dist", dict(ep=2, moe_grouped_gemm=True)),
}


def same_megatron_output(torch_out: Path, copy_out: Path) -> None:
    """The two Megatron checkpoints hold the same files: the same names, every file that is not a
    ``torch.save`` archive byte for byte, rank files and torch_dist checkpoints the same objects
    (``tests/test_copy_targets``: keys in order, args, tensors bitwise, metadata)."""
    from tests.test_copy_targets import _same_dist, _same_rank_file, _tree

    assert _tree(copy_out) == _tree(torch_out)
    for rel in _tree(torch_out):
        if rel.name == "model_optim_rng.pt":
            _same_rank_file(torch_out / rel, copy_out / rel)
        elif rel.suffix not in (".distcp", ".pt") and rel.name != ".metadata":
            assert (copy_out / rel).read_bytes() == (torch_out / rel).read_bytes(), rel
        elif rel.name == ".metadata":
            _same_dist(torch_out / rel.parent, copy_out / rel.parent)


def both_paths_megatron(src: Path, out: Path, taken: list[bool], monkeypatch, to: str, **options) -> Path:
    """``src`` -> ``to`` by the copy path (asserted taken) and by the torch path, the same output
    (``same_megatron_output``); returns the copy path's."""
    fast, slow = out / "copy", out / "torch"
    convert(src, fast, to=to, workers=2, **options)
    assert taken[-1] is True, f"{src}: the copy path was not taken"
    monkeypatch.setenv("PMZ_COPY_PATH", "0")
    convert(src, slow, to=to, workers=1, **options)  # (in this process: worker processes cost seconds)
    monkeypatch.delenv("PMZ_COPY_PATH")
    same_megatron_output(slow, fast)
    return fast


@pytest.mark.parametrize("case", sorted(MEGATRON_TARGETS))
def test_moe_megatron_targets_on_the_copy_path_are_the_torch_paths(models, tmp_path, monkeypatch, paths_taken, case):
    name, to, options = MEGATRON_TARGETS[case]
    model, src = models["sources"][name]
    fast = both_paths_megatron(src, tmp_path, paths_taken, monkeypatch, to, **options)
    if "grouped" in case and to == "megatron":
        state = torch.load(next(fast.rglob("model_optim_rng.pt")), weights_only=False)
        assert any(k.endswith("mlp.experts.weight1") for k in state.get("model", state.get("model0", {})))
    convert(fast, tmp_path / "back", to="hf", workers=2)  # and back: the HF tensors bitwise
    assert paths_taken[-1] is True
    assert_same_tensors(Path(models["hf"][model]), tmp_path / "back")


@pytest.mark.parametrize("to,options", [("megatron", dict(tp=1, ep=4)), ("megatron", dict(tp=2, pp=2)),
                                        ("megatron-dist", dict())])
def test_grouped_gemm_sources_to_megatron_on_the_copy_path(models, tmp_path, monkeypatch, paths_taken, to, options):
    """A GroupedMLP source resharded (SequentialMLP at another EP, GroupedMLP kept at another TP/PP,
    torch_dist) and with tiny transposition blocks (many ``Transposed`` bands per expert)."""
    import converters.copy_path.grouped_moe as grouped_moe
    import converters.copy_path.megatron_moe as megatron_moe

    monkeypatch.setattr(grouped_moe, "TRANSPOSE_BYTES", 1000)  # an expert's [2F, H] = 8 KiB: bands of 3-8 rows
    monkeypatch.setattr(megatron_moe, "TRANSPOSE_BYTES", 1500)
    src = tmp_path / "gg"
    convert(models["hf"]["shared"], src, to="megatron", tp=2, ep=2, moe_grouped_gemm=True, workers=1)
    both_paths_megatron(src, tmp_path / "out", paths_taken, monkeypatch, to, **options)


@pytest.mark.parametrize("name,to", [("q2_torch", "megatron"), ("q3_torch_dist", "megatron")])
def test_megatron_core_moe_checkpoints_resharded_on_the_copy_path(megatron_core, tmp_path, monkeypatch, paths_taken,
                                                                 name, to):
    both_paths_megatron(megatron_core / name, tmp_path, paths_taken, monkeypatch, to, tp=1, ep=4)


def test_cli_moe_conversion_to_megatron_never_imports_torch(models, tmp_path):
    from tests.test_copy_targets import run_pmz_without_torch

    hf = models["hf"]["qwen3"]
    run_pmz_without_torch("convert", hf, str(tmp_path / "legacy"), "--to", "megatron", "--tp", "2", "--ep", "2",
                          "--moe-grouped-gemm")
    run_pmz_without_torch("convert", str(tmp_path / "legacy"), str(tmp_path / "dist"), "--to", "megatron-dist")
    run_pmz_without_torch("convert", str(tmp_path / "dist"), str(tmp_path / "hf"), "--to", "hf")
    assert_same_tensors(Path(hf), tmp_path / "hf")


@pytest.mark.parametrize("flags,fragments", [(["--ep", "3"], ["num_experts=8", "--ep 3"]),
                                             (["--tp", "2", "--ep", "16"], ["--ep 16"])])
def test_bad_expert_layouts_fail_as_on_the_torch_path(models, tmp_path, capsys, monkeypatch, flags, fragments):
    errors = {}
    for copy_path in ("1", "0"):
        monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
        dst = tmp_path / "out" / "mc"
        before = snapshot(dst.parent)
        assert pmz(["convert", models["hf"]["qwen3"], str(dst), "--to", "megatron", *flags]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert not dst.exists() and snapshot(dst.parent) == before
        errors[copy_path] = err
    assert errors["1"] == errors["0"]
    for fragment in fragments:
        assert fragment in errors["1"], errors["1"]


@pytest.mark.parametrize("numpy", [True, False])
def test_transposed_bytes_for_every_element_size(monkeypatch, numpy):
    """``transpose.transposed_bytes`` (the one computation of grouped-GEMM conversions) is the transpose, for
    tall and wide matrices of 1-, 2-, 4- and 8-byte elements, by numpy and without it."""
    import random
    import struct
    import sys

    if not numpy:
        monkeypatch.setitem(sys.modules, "numpy", None)  # ``import numpy`` raises ImportError

    from converters.copy_path.ops import Data, Transposed
    from converters.copy_path.transpose import transposed_bytes

    rng = random.Random(3)
    for size, fmt in ((1, "B"), (2, "H"), (4, "I"), (8, "Q")):
        for rows, cols in ((3, 5), (5, 3), (1, 7), (7, 1), (4, 4)):
            values = [rng.getrandbits(8 * size) for _ in range(rows * cols)]
            data = struct.pack(f"<{rows * cols}{fmt}", *values)
            halves = (Data(data[: len(data) // 2 // size * size]), Data(data[len(data) // 2 // size * size:]))
            got = struct.unpack(f"<{rows * cols}{fmt}", bytes(transposed_bytes(Transposed(rows, cols, size, halves),
                                                                               None)))
            assert list(got) == [values[r * cols + c] for c in range(cols) for r in range(rows)]
