"""Qwen3-VL-MoE (Qwen3-VL's tower, DeepStack and interleaved M-RoPE; Qwen3-MoE's experts) against transformers'
``Qwen3VLMoeForConditionalGeneration`` (fp32, CPU; gloo for two ranks), on the cases of
tests/workers_qwen3_vl_moe.py: two images of different sizes and a two-frame video in one batch, a mixed
batch with a text-only row (left padding), a packed batch against each sequence alone, the load-balancing
loss where the case's config asks for it, and two SGD steps with every vision, text, router and expert
gradient compared. Layouts: TP2+SP, EP2 (experts split), PP2 with the stage boundary inside the DeepStack
layers (the DeepStack tensor and the router statistics both cross it), PP2 x VPP2, CP2 and Ulysses2; bf16 in
one process, TP2+SP (both cases) and EP2 (tests/workers_vl.py ``bf16_records``).
Then: what transformers writes on disk (fused experts) and reads back, the original releases' transposed
experts read, ``save_pretrained`` read back by transformers, bad input in one line.

Cost on 2 cores: ~50 s for the module (measured 46 s): ~33 s the two-rank group (six layouts in one spawn),
~10 s the single-process layouts and the two random checkpoints, ~3 s the rest; the three bf16 layouts of the
two-rank group add ~3 s (measured 3.3 s at load 21).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed import records_on_ranks
from tests.vl_cases import VL_BF16_BOUNDS, VL_BF16_REPORTED, vl_bf16_bound
from tests.workers_qwen3_vl import misplaced_placeholders, qwen3_vl_batch
from tests.workers_qwen3_vl_moe import BASE, QWEN3_VL_MOE_CASES, suite, write_qwen3_vl_moe_model
from tests.workers_vl import _inputs

FP32_TOL = 1e-5
GRAD_REL_TOL = 1e-4

LAYOUTS = {
    1: [("m_untied", {}, {"save": True}), ("m_tied", {}), ("m_untied", {}, {"forward_backward": True}),
        # one micro-batch: the load-balancing loss is transformers' own number (it is per micro-batch)
        ("m_tied", {}, {"forward_backward": True, "aux": True, "microbatches": 1}), ("m_untied", {}, {"bf16": True})],
    2: [("m_tied", {"tp": 2, "sequence_parallel": True}, {"save": True}), ("m_untied", {"ep": 2}, {"save": True}),
        # layer 0 on the first stage, layer 1 (DeepStack feature 1) behind the boundary, router sums carried
        ("m_tied", {"pp": 2, "num_layers_in_first_pipeline_stage": 1},
         {"forward_backward": True, "aux": True, "microbatches": 1}),
        ("m_tied", {"pp": 2, "vpp": 2}, {"forward_backward": True}),
        ("m_untied", {"cp": 2}), ("m_tied", {"ulysses": 2}), ("m_untied", {"fsdp": True}),
        # bf16 as users run it (~3 s together): TP2+SP both cases, EP2
        ("m_tied", {"tp": 2, "sequence_parallel": True}, {"bf16": True}),
        ("m_untied", {"tp": 2, "sequence_parallel": True}, {"bf16": True}), ("m_tied", {"ep": 2}, {"bf16": True})],
    # experts over EP2 inside TP2+SP: every rank holds half of the experts' slices and a quarter of the tokens
    4: [("m_tied", {"tp": 2, "sequence_parallel": True, "ep": 2}, {"save": True})],
}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_vl_moe")
    return tuple(sorted((name, write_qwen3_vl_moe_model(root, name, seed=40 + i))
                        for i, name in enumerate(QWEN3_VL_MOE_CASES)))


@functools.lru_cache(maxsize=None)
def _records(world: int, dirs: tuple) -> list[tuple]:
    return records_on_ranks(world, suite, dict(dirs), LAYOUTS[world])


METRICS = {"logits": r"logits_.*", "loss": r"loss_.*|step\d_loss.*", "aux": r"loss_aux_.*", "grads": r"grads_.*",
           "saved": r"saved_.*"}  # save_pretrained after training, read by transformers (TP2+SP, EP2, one process)
BF16 = "bf16_.*"  # ours in bf16 against transformers' bf16, both against fp32 (VL_BF16_BOUNDS)
BF16_WORLDS = sorted({w for w, layouts in LAYOUTS.items() for _, _, *opts in layouts if opts and opts[0].get("bf16")})


@pytest.mark.parametrize("world", sorted(LAYOUTS))
@pytest.mark.parametrize("metric", sorted(METRICS))
def test_qwen3_vl_moe_parity(moe_dirs, world, metric):
    records = [r for r in _records(world, moe_dirs) if not re.fullmatch(BF16, r[2])]
    assert len({(case, layout) for case, layout, *_ in records}) == len(
        [lay for lay in LAYOUTS[world] if not (len(lay) > 2 and lay[2].get("bf16"))]), "layouts missing"
    pat = re.compile(METRICS[metric])
    selected = [r for r in records if pat.fullmatch(r[2])]
    assert selected, f"no {metric} records"
    if metric in ("loss", "grads"):  # every layout reports them
        assert {(c, layout) for c, layout, *_ in selected} == {(c, layout) for c, layout, *_ in records}
    bound = GRAD_REL_TOL if metric == "grads" else FP32_TOL
    bad = [f"{case} {layout} {name}={value:.3g}" for case, layout, name, value in selected if not value <= bound]
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("world", BF16_WORLDS)
def test_qwen3_vl_moe_in_bf16_is_as_close_as_transformers_own(moe_dirs, world):
    """Every bf16 layout has the three bounded quantities (tests/workers_vl.py ``bf16_records``: at TP2 the
    logits and loss with ``ParallelConfig.tp_reduce_in_fp32``, the ratio of the default model), within
    tests/vl_cases.py ``vl_bf16_bound`` (TP2 with the flag and EP2 compute what one process does: the exact bounds)."""
    from parallel import ParallelConfig

    selected = [r for r in _records(world, moe_dirs) if re.fullmatch(BF16, r[2]) and r[2] not in VL_BF16_REPORTED]
    assert {r[:3] for r in selected} == {(case, ParallelConfig(**kwargs).describe(), name)
                                         for case, kwargs, *opts in LAYOUTS[world] if opts and opts[0].get("bf16")
                                         for name in VL_BF16_BOUNDS}, selected
    bad = [f"{case} {layout} {name}={value:.3g}" for case, layout, name, value in selected
           if not value <= vl_bf16_bound(name, layout)]
    assert not bad, "; ".join(bad)


# ------------------------------------------------------------------ checkpoints, config, bad input
@pytest.fixture(scope="module")
def hf_moe(moe_dirs):
    from transformers import Qwen3VLMoeForConditionalGeneration

    return {name: Qwen3VLMoeForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
            for name, d in moe_dirs}


@pytest.fixture(scope="module")
def ours_moe(moe_dirs):
    from models.qwen3_vl_moe import build_parallel_model

    return {name: build_parallel_model(d).eval() for name, d in moe_dirs}


def _on_disk(directory) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(Path(directory) / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_transformers_writes_fused_experts_we_read(moe_dirs, ours_moe):
    """transformers 5.24 saves each layer's experts fused (``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``);
    our weight map names them per expert: apart from that, the names and shapes are exactly the same."""
    from models.common.weights import hf_shapes

    model = ours_moe["m_untied"]
    on_disk = _on_disk(dict(moe_dirs)["m_untied"])
    ours = hf_shapes(model.config, model.weight_map)
    moe = model.config.moe
    e, f, h = moe.num_experts, moe.moe_intermediate_size, model.config.hidden_size
    fused = {}
    for name, shape in ours.items():
        match = re.fullmatch(r"(.*\.mlp\.experts\.)\d+\.(gate_proj|up_proj|down_proj)\.weight", name)
        if match is None:
            fused[name] = shape
        elif match.group(2) == "down_proj":
            fused[match.group(1) + "down_proj"] = (e, h, f)
        else:
            fused[match.group(1) + "gate_up_proj"] = (e, 2 * f, h)
    assert fused == on_disk
    # mlp_only_layers=[1]: layer 1 keeps the dense MLP, layers 0 and 2 are sparse
    assert "model.language_model.layers.1.mlp.gate_proj.weight" in on_disk
    assert "model.language_model.layers.0.mlp.gate.weight" in on_disk and (e, 2 * f, h) != (e, h, 2 * f)


@pytest.mark.parametrize("name", sorted(QWEN3_VL_MOE_CASES))
def test_checkpoint_directory_gives_transformers_logits(hf_moe, ours_moe, name):
    """``build_parallel_model(dir)`` of transformers' ``save_pretrained``: the same logits (and the routing
    matters: without the router's renormalisation of its top-k weights they move far beyond the bound)."""
    model, hf = ours_moe[name], hf_moe[name]
    batch = _inputs(qwen3_vl_batch(BASE[name], "images_and_video"))
    valid = batch["attention_mask"].bool()
    blocks = model.moe_blocks()
    with torch.no_grad():
        ref = hf(**batch).logits[valid]
        exact = model(**batch, gather_logits=True).logits[valid]
        for blk in blocks:
            blk.moe = dataclasses.replace(blk.moe, norm_topk_prob=False)
        try:
            unnormalised = model(**batch, gather_logits=True).logits[valid]
        finally:
            for blk in blocks:
                blk.moe = dataclasses.replace(blk.moe, norm_topk_prob=True)
    assert blocks and (exact - ref).abs().max() <= FP32_TOL
    assert (unnormalised - ref).abs().max() > 1e-3


def _release_layout(src: Path, dst: Path) -> Path:
    """``src`` (transformers' save) with every layer's experts as the original releases store them: transposed,
    ``gate_up_proj [E, H, 2F]``, ``down_proj [E, F, H]`` (what transformers transposes back on load)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    tensors = {k: v.transpose(1, 2).contiguous() if k.endswith((".experts.gate_up_proj", ".experts.down_proj")) else v
               for k, v in tensors.items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_release_layout_of_experts_is_read(moe_dirs, hf_moe, tmp_path):
    """The original releases store experts transposed (``[E, H, 2F]``, ``[E, F, H]``), which transformers
    transposes on load: read as strided per-expert views, the same logits as transformers' model of that
    directory; saving that model writes transformers' own layout, bitwise transformers' save. A fused tensor
    in neither layout is refused naming both shapes."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from models.common.errors import CheckpointError
    from models.qwen3_vl_moe import build_parallel_model

    src = Path(dict(moe_dirs)["m_untied"])
    release = _release_layout(src, tmp_path / "release")
    assert _on_disk(release)["model.language_model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 96)
    hf = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(release), dtype=torch.float32).eval()
    model = build_parallel_model(release).eval()
    batch = _inputs(qwen3_vl_batch(BASE["m_untied"], "images_and_video"))
    valid = batch["attention_mask"].bool()
    with torch.no_grad():
        ref, ours = hf(**batch).logits[valid], model(**batch, gather_logits=True).logits[valid]
        assert (ours - ref).abs().max() <= FP32_TOL
        assert (hf_moe["m_untied"](**batch).logits[valid] - ref).abs().max() == 0  # transformers read it back
    model.save_pretrained(tmp_path / "saved")
    assert not _differing(_stored(tmp_path / "saved"), _stored(src))

    bad = tmp_path / "bad"
    shutil.copytree(release, bad)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.language_model.layers.2.mlp.experts.down_proj"
    tensors[name] = tensors[name].reshape(4, 24, 128).contiguous()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    refused = (r"fused experts model\.language_model\.layers\.2\.mlp\.experts\.down_proj have shape \(4, 24, 128\), "
               r"the config implies \(4, 64, 48\) \(E, hidden_size, moe_intermediate_size\) or, as the original "
               r"releases store them, \(4, 48, 64\)")
    with pytest.raises(CheckpointError, match=refused) as err:
        build_parallel_model(bad)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("where", "change", "match"), [
    ("vision_config", {"deepstack_visual_indexes": [0, 3]},
     r"qwen3_vl_moe: vision_config\.deepstack_visual_indexes=\[0, 3\] names block\(s\) \[3\] but the tower has "
     r"depth=3 \(blocks 0\.\.2\)"),
    ("vision_config", {"deepstack_visual_indexes": [0, 1, 2, 5]},
     r"deepstack_visual_indexes=\[0, 1, 2, 5\] names block\(s\) \[5\] but the tower has depth=3"),
    ("text_config", {"num_experts_per_tok": 5},
     r"qwen3_vl_moe config: num_experts_per_tok=5 must be between 1 and num_experts=4"),
])
def test_bad_configs_are_refused_in_one_line(moe_dirs, tmp_path, where, change, match):
    from models.common.config import UnsupportedConfigError
    from models.qwen3_vl_moe import build_parallel_model

    src = tmp_path / "src"
    shutil.copytree(dict(moe_dirs)["m_untied"], src)
    data = json.loads((src / "config.json").read_text())
    data[where].update(change)
    (src / "config.json").write_text(json.dumps(data))
    with pytest.raises(UnsupportedConfigError, match=match) as err:
        build_parallel_model(src)
    assert "\n" not in str(err.value)


MISPLACED = (r"the image tokens \d+\.\.\d+ of row 0 are 5 tokens but image 0 has grid \(t, h, w\) = \(1, 6, 4\), "
             r"i\.e\. 6 tokens")


def test_image_tokens_not_matching_the_features_are_refused(ours_moe):
    """Placeholder tokens that do not match the images' features (one moved to another row; one image token
    too few): one line naming the numbers, before the tower runs."""
    from models.qwen3_vl_moe.positions import VisionInputError

    model = ours_moe["m_untied"]
    encoded = []
    hook = model.visual.register_forward_hook(lambda *a: encoded.append(1))
    short = qwen3_vl_batch(BASE["m_untied"], "images_and_video")
    ids = short["input_ids"].clone()
    ids[0, (ids[0] == QWEN3_VL_MOE_CASES["m_untied"]["image_token_id"]).nonzero()[-1, 0]] = 5
    try:
        with pytest.raises(VisionInputError, match=MISPLACED) as moved:
            model(**_inputs(misplaced_placeholders(BASE["m_untied"])))
        with pytest.raises(VisionInputError, match=r"input_ids hold 7 image tokens \(id 96\) but image_grid_thw "
                                                   r"gives 8 after 2x2 merging") as fewer:
            model(**_inputs({**short, "input_ids": ids, "mm_token_type_ids": None}))
    finally:
        hook.remove()
    assert not encoded and "\n" not in str(moved.value) + str(fewer.value)


def test_config_read_as_plain_json_equals_transformers(moe_dirs):
    """What the converters read (config.json as data) gives transformers' own parsing: the top-level
    ``tie_word_embeddings`` alone ties (``text_config`` says true in both files, transformers ignores it), the
    router always renormalises, ``num_local_experts`` is the expert count."""
    from transformers import AutoConfig

    from converters.formats.hf_config import read_hf_config
    from models.qwen3_vl_moe.config import model_config

    for name, directory in moe_dirs:
        ours = model_config(read_hf_config(directory))
        assert ours == model_config(AutoConfig.from_pretrained(directory)), name
        data = json.loads((Path(directory) / "config.json").read_text())
        assert data["text_config"]["tie_word_embeddings"] is True
        assert ours.tie_word_embeddings == data["tie_word_embeddings"] == (name == "m_tied")
        assert ours.moe.norm_topk_prob and ours.moe.num_experts == data["text_config"]["num_local_experts"] == 4


def _stored(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(directory).glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _differing(got: dict, want: dict) -> list[str]:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:6]
    return [k for k, t in want.items() if not (got[k].dtype == t.dtype and torch.equal(got[k], t))]


@pytest.mark.parametrize("name", sorted(QWEN3_VL_MOE_CASES))
def test_save_pretrained_writes_what_transformers_reads(moe_dirs, hf_moe, ours_moe, tmp_path, name):
    """``save_pretrained`` stores each layer's experts fused as transformers does (``gate_up_proj [E, 2F, H]``,
    ``down_proj [E, H, F]``): every tensor bitwise the source directory's (transformers' save), split over
    several files with an index when ``max_shard_size`` asks (a fused tensor whole in one file);
    transformers' ``from_pretrained`` of it reports no missing or unexpected key and gives the same logits."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    src = dict(moe_dirs)[name]
    for limit, out in (("5GB", tmp_path / "one"), (60_000, tmp_path / "many")):
        ours_moe[name].save_pretrained(out, max_shard_size=limit)
        assert not _differing(_stored(out), _stored(src))
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2 and "model.language_model.layers.0.mlp.experts.gate_up_proj" in index
    hf, info = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(tmp_path / "many"), dtype=torch.float32,
                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    batch = _inputs(qwen3_vl_batch(BASE[name], "images_and_video"))
    valid = batch["attention_mask"].bool()
    with torch.no_grad():
        assert torch.equal(hf.eval()(**batch).logits[valid], hf_moe[name](**batch).logits[valid])
