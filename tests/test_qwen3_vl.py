"""Qwen3-VL (learned-position vision tower with DeepStack, Qwen3 text with interleaved M-RoPE) against
transformers' ``Qwen3VLForConditionalGeneration`` (fp32, CPU; gloo for two ranks), on the cases and
batches of tests/workers_qwen3_vl.py: two images of different sizes and a two-frame video in one batch, a
mixed batch with a text-only row (right and left padding), a packed batch; two SGD steps with every vision
and text gradient compared; ``save_pretrained`` bitwise. One group of processes per world size runs every
layout of that size. Positions must be ``torch.equal`` to transformers' ``get_rope_index``. bf16 against
transformers' bf16 (tests/workers_vl.py ``bf16_records``) in one process, TP2+SP, CP2 and Ulysses2 (the four
two-rank bf16 layouts add ~2 s: 2.1 s at load 21).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed import records_on_ranks
from tests.vl_cases import VL_BF16_BOUNDS, VL_BF16_REPORTED, vl_bf16_bound
from tests.workers_qwen3_vl import (
    BATCHES,
    QWEN3_VL_CASES,
    misplaced_placeholders,
    qwen3_vl_batch,
    qwen3_vl_packed_batch,
    suite,
    write_qwen3_vl_model,
)
from tests.workers_vl import _inputs, _segments

FP32_TOL = 1e-5
GRAD_REL_TOL = 1e-4

LAYOUTS = {
    1: [("q3_untied", {}), ("q3_tied", {}), ("q3_tied", {}, {"forward_backward": True, "microbatches": 2}),
        ("q3_untied", {}, {"bf16": True}), ("q3_tied", {}, {"bf16": True})],
    2: [("q3_tied", {"tp": 2, "sequence_parallel": True}), ("q3_untied", {"tp": 2}),
        ("q3_untied", {"cp": 2, "recompute": "full"}), ("q3_tied", {"ulysses": 2}), ("q3_untied", {"fsdp": True}),
        ("q3_tied", {"cp": 2}, {"forward_backward": True}),
        # the tower and the two DeepStack-fed layers on the first stage, the last layer and the head on the second
        ("q3_untied", {"pp": 2, "num_layers_in_first_pipeline_stage": 2}, {"forward_backward": True}),
        # the stage boundary inside the DeepStack layers: layer 1's feature travels to the second stage
        ("q3_tied", {"pp": 2, "num_layers_in_first_pipeline_stage": 1}, {"forward_backward": True}),
        # one layer per virtual chunk: feature 1 to global stage 1 (rank 1), nothing to the chunks after it
        ("q3_tied", {"pp": 2, "vpp": 2}, {"forward_backward": True}),
        ("q3_untied", {"tp": 2, "sequence_parallel": True}, {"bad_input": True}),
        ("q3_untied", {"ulysses": 2}, {"bad_input": True}),
        # bf16 as users run it (~3 s together): TP2+SP both cases, CP2 and Ulysses2 with images in both parts
        ("q3_tied", {"tp": 2, "sequence_parallel": True}, {"bf16": True}),
        ("q3_untied", {"tp": 2, "sequence_parallel": True}, {"bf16": True}),
        ("q3_untied", {"cp": 2}, {"bf16": True}), ("q3_tied", {"ulysses": 2}, {"bf16": True})],
    # combined layouts (one 4-rank group, ~70 s on 2 cores: marked slow): the DeepStack tensor in SP slices
    # over cp ranks and across a pipeline boundary inside the DeepStack layers
    4: [("q3_tied", {"tp": 2, "sequence_parallel": True, "cp": 2}),
        ("q3_tied", {"tp": 2, "sequence_parallel": True, "pp": 2, "num_layers_in_first_pipeline_stage": 1},
         {"forward_backward": True}),
        ("q3_untied", {"tp": 2, "ulysses": 2}, {"forward_backward": True})],
}


@pytest.fixture(scope="module")
def q3_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_vl")
    return tuple(sorted((name, write_qwen3_vl_model(root, name, seed=20 + i)) for i, name in enumerate(QWEN3_VL_CASES)))


@functools.lru_cache(maxsize=None)
def _records(world: int, dirs: tuple) -> list[tuple]:
    return records_on_ranks(world, suite, dict(dirs), LAYOUTS[world])


METRICS = {"logits": r"logits_.*", "loss": r"loss_.*|step\d_loss.*", "grads": r"grads_.*", "saved": "saved_tensors",
           "bf16": r"bf16_.*"}
BF16_WORLDS = {w for w, layouts in LAYOUTS.items() for _, _, *opts in layouts if opts and opts[0].get("bf16")}


@pytest.mark.parametrize(("world", "metric"), [pytest.param(w, m, marks=[pytest.mark.slow] if w == 4 else [])
                                             for w in sorted(LAYOUTS) for m in sorted(METRICS)
                                             if m != "bf16" or w in BF16_WORLDS])
def test_qwen3_vl_parity(q3_dirs, world, metric):
    records = [r for r in _records(world, q3_dirs) if r[2] not in ("vision_share", "bad_input", *VL_BF16_REPORTED)]
    pat = re.compile(METRICS[metric])
    selected = [r for r in records if pat.fullmatch(r[2])]
    if metric == "bf16":  # every bf16 layout has the three bounded quantities (tests/workers_vl.py bf16_records)
        from parallel import ParallelConfig

        want = {(case, ParallelConfig(**kwargs).describe(), name) for case, kwargs, *opts in LAYOUTS[world]
                if opts and opts[0].get("bf16") for name in VL_BF16_BOUNDS}
        assert {r[:3] for r in selected} == want
    if metric in ("loss", "grads"):  # every fp32 layout (forward_backward ones have no logits or save records)
        records = [r for r in records if not r[2].startswith("bf16_")]
        from parallel import ParallelConfig

        assert {(case, layout) for case, layout, *_ in selected} == {
            (case, layout) for case, layout, *_ in records}, f"layouts without {metric} records"
        fp32 = [(case, kwargs) for case, kwargs, *opts in LAYOUTS[world]
                if not (opts and (opts[0].get("bf16") or opts[0].get("bad_input")))]
        assert len({(case, layout) for case, layout, *_ in selected}) == len(fp32), "layouts missing"
        assert all(any(ParallelConfig(**kwargs).describe() in layout for c, layout, *_ in selected if c == case)
                   for case, kwargs in fp32)
    assert selected, f"no {metric} records"
    bound = GRAD_REL_TOL if metric == "grads" else 0.0 if metric == "saved" else FP32_TOL
    bad = [f"{case} {layout} {name}={value:.3g}" for case, layout, name, value in selected
           if not value <= (vl_bf16_bound(name, layout) if name in VL_BF16_BOUNDS else bound)]
    assert not bad, "; ".join(bad)


def test_bf16_cp_and_ulysses_ranks_each_place_visual_tokens(q3_dirs):
    """The bf16 CP2 and Ulysses2 layouts run with images in both ranks' parts of the sequence."""
    counts = {}
    for _, layout, name, value in _records(2, q3_dirs):
        if name == "bf16_local_visual_tokens":
            counts.setdefault(layout, []).append(value)
    assert len(counts) == 2 and all(len(c) == 2 and min(c) > 0 for c in counts.values()), counts


def test_cp_and_ulysses_ranks_share_the_vision_work(q3_dirs):
    """Each cp/ulysses rank encodes only its share of whole images/videos; the shares add up to every patch."""
    records = [r for r in _records(2, q3_dirs) if r[2] == "vision_share"]
    shared = {r[1] for r in records if re.search(r"(cp|ulysses)=2", r[1])}
    assert len(shared) == 2, shared
    for layout in shared:
        shares = [r[3] for r in records if r[1] == layout]
        assert all(share < 1.0 for share in shares) and sum(shares) == pytest.approx(1.0), (layout, shares)


# ------------------------------------------------------------------ positions, weights, bad input
@pytest.fixture(scope="module")
def hf3(q3_dirs):
    from transformers import Qwen3VLForConditionalGeneration

    return {name: Qwen3VLForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
            for name, d in q3_dirs}


@pytest.fixture(scope="module")
def ours3(q3_dirs):
    from models.qwen3_vl import build_parallel_model

    return {name: build_parallel_model(d).eval() for name, d in q3_dirs}


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize("name", sorted(QWEN3_VL_CASES))
def test_positions_match_get_rope_index(hf3, ours3, name, kind, side):
    """Videos frame by frame (each frame behind its timestamp takes a grid (1, h, w)): ``torch.equal``."""
    batch = qwen3_vl_batch(name, kind, seed=3, padding_side=side)
    grids = {k: batch[k] for k in ("image_grid_thw", "video_grid_thw")}
    want = hf3[name].model.get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                          attention_mask=batch["attention_mask"],
                                          **{k: None if v is None else v.clone() for k, v in grids.items()})[0]
    got = ours3[name].rope_positions(batch["input_ids"], attention_mask=batch["attention_mask"],
                                     mm_token_type_ids=batch["mm_token_type_ids"], **grids)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(QWEN3_VL_CASES))
def test_packed_positions_match_each_segment(hf3, ours3, name):
    packed = qwen3_vl_packed_batch(name, seed=5)
    want = [hf3[name].model.get_rope_index(seg["input_ids"], mm_token_type_ids=seg["mm_token_type_ids"],
                                           image_grid_thw=seg.get("image_grid_thw"),
                                           video_grid_thw=seg.get("video_grid_thw"))[0][:, 0]
            for seg in _segments(packed, hf3[name].config)]
    got = ours3[name].rope_positions(packed["input_ids"], cu_seqlens=packed["cu_seqlens"],
                                     image_grid_thw=packed["image_grid_thw"], video_grid_thw=packed["video_grid_thw"])
    assert torch.equal(got.reshape(3, -1), torch.cat(want, dim=1))


def test_transformers_writes_the_names_we_read(q3_dirs, ours3):
    """transformers 5.24 saves Qwen3-VL under its in-memory names; our weight map lists exactly those."""
    from safetensors import safe_open

    from models.common.weights import hf_shapes

    path = Path(dict(q3_dirs)["q3_untied"])
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        on_disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    model = ours3["q3_untied"]
    assert hf_shapes(model.config, model.weight_map) == on_disk
    assert "model.visual.deepstack_merger_list.1.norm.weight" in on_disk and "model.visual.pos_embed.weight" in on_disk


def test_deepstack_and_interleaving_matter(hf3, ours3):
    """The parity tests can fail: without the DeepStack additions, or with Qwen2-VL's sectioned M-RoPE,
    the logits move far beyond the bound."""
    from models.common.causal_lm import ParallelCausalLM

    model, hf = ours3["q3_untied"], hf3["q3_untied"]
    batch = _inputs(qwen3_vl_batch("q3_untied", "images_and_video"))
    with torch.no_grad():
        ref = hf(**batch).logits
        exact = model(**batch, gather_logits=True).logits
        model.run_layers = functools.partial(ParallelCausalLM.run_layers, model)
        try:
            plain = model(**batch, gather_logits=True).logits
        finally:
            del model.run_layers
        model.rotary.mrope_interleaved = False
        try:
            sectioned = model(**batch, gather_logits=True).logits
        finally:
            model.rotary.mrope_interleaved = True
    valid = batch["attention_mask"].bool()
    assert (exact - ref)[valid].abs().max() <= 1e-5
    assert (plain - ref)[valid].abs().max() > 1e-2 and (sectioned - ref)[valid].abs().max() > 1e-3


MISPLACED = (r"the image tokens \d+\.\.\d+ of row 0 are 5 tokens but image 0 has grid \(t, h, w\) = \(1, 6, 4\), "
             r"i\.e\. 6 tokens")


def test_placeholders_not_matching_a_sample_are_refused(ours3):
    """Tokens moved between samples (totals unchanged): one line naming the run and the grid, before the tower."""
    from models.qwen3_vl.positions import VisionInputError

    model = ours3["q3_untied"]
    encoded = []
    hook = model.visual.register_forward_hook(lambda *a: encoded.append(1))
    try:
        with pytest.raises(VisionInputError, match=MISPLACED) as err:
            model(**_inputs(misplaced_placeholders("q3_untied")))
    finally:
        hook.remove()
    assert not encoded and "\n" not in str(err.value)


def test_placeholders_not_matching_a_sample_are_refused_on_every_rank(q3_dirs):
    """TP2+SP and Ulysses2 (whose ranks share the tower's work): every rank raises, none hangs."""
    refused = [r for r in _records(2, q3_dirs) if r[2] == "bad_input"]
    assert len(refused) == 4, refused
    assert all(re.search(MISPLACED, r[3]) for r in refused), refused


@pytest.mark.parametrize(("change", "match"), [
    ({"deepstack_visual_indexes": [0, 3]}, r"deepstack_visual_indexes=\[0, 3\] names block\(s\) \[3\] but the tower "
                                           r"has depth=3 \(blocks 0\.\.2\)"),
    ({"deepstack_visual_indexes": [1, 1]}, r"deepstack_visual_indexes=\[1, 1\] lists a block twice"),
    ({"deepstack_visual_indexes": [0, 1, 2], "depth": 3, "_layers": 2},
     r"3 DeepStack features .* but the text model has num_hidden_layers=2"),
    ({"hidden_act": "relu"}, r"vision_config\.hidden_act='relu' is not supported"),
])
def test_bad_configs_are_refused_in_one_line(q3_dirs, tmp_path, change, match):
    from models.common.config import UnsupportedConfigError
    from models.qwen3_vl import build_parallel_model

    src = tmp_path / "src"
    shutil.copytree(dict(q3_dirs)["q3_untied"], src)
    data = json.loads((src / "config.json").read_text())
    change = dict(change)
    if "_layers" in change:
        data["text_config"]["num_hidden_layers"] = change.pop("_layers")
    data["vision_config"].update(change)
    (src / "config.json").write_text(json.dumps(data))
    with pytest.raises(UnsupportedConfigError, match=match) as err:
        build_parallel_model(src)
    assert "\n" not in str(err.value)


def test_config_read_as_plain_json_equals_transformers(q3_dirs, tmp_path):
    """What the converters read (config.json as data, no transformers) gives transformers' own parsing, also
    with the vision fields left to transformers' defaults (hidden_act, deepstack_visual_indexes)."""
    from transformers import AutoConfig

    from converters.formats.hf_config import read_hf_config
    from models.qwen3_vl.config import model_config

    defaults = tmp_path / "defaults"
    shutil.copytree(dict(q3_dirs)["q3_tied"], defaults)
    data = json.loads((defaults / "config.json").read_text())
    for key in ("hidden_act", "deepstack_visual_indexes", "rope_parameters"):
        data["vision_config"].pop(key)
    data["vision_config"]["depth"] = 27  # transformers' default DeepStack blocks (8, 16, 24) must exist
    data["text_config"]["num_hidden_layers"] = 3
    (defaults / "config.json").write_text(json.dumps(data))
    for directory in [Path(d) for _, d in q3_dirs] + [defaults]:
        ours = model_config(read_hf_config(directory))
        assert ours == model_config(AutoConfig.from_pretrained(str(directory))), directory.name
    assert ours.vision.deepstack_visual_indexes == (8, 16, 24) and ours.vision.hidden_act == "gelu_pytorch_tanh"
