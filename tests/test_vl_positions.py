"""Qwen2-VL positions and input checks (models/qwen2_vl/positions.py) against transformers.

Every expected value comes from transformers itself: ``Qwen2VLModel.get_rope_index`` for the
M-RoPE positions and rope deltas, ``transformers.vision_utils`` for the vision tower's patch
coordinates and attention segments, and ``Qwen2VLForConditionalGeneration.forward`` for the
batches of tests/vl_cases.py (which the smoke tests feed it unchanged).
"""

from __future__ import annotations

import pytest
import torch

from models.qwen2_vl.positions import (
    VisionInputError,
    check_multimodal_inputs,
    merged_token_counts,
    mrope_positions,
    mrope_positions_packed,
    vision_cu_seqlens,
    vision_patch_positions,
)
from tests.vl_cases import VL_BATCH_KINDS, VL_CASES, vl_batch, vl_packed_batch, write_vl_model

CASES = tuple(VL_CASES)


@pytest.fixture(scope="module")
def hf_vl(tmp_path_factory):
    """Each case written by ``write_vl_model`` and loaded back by transformers (eval, float32)."""
    from transformers import Qwen2VLForConditionalGeneration

    root = tmp_path_factory.mktemp("vl_models")
    dirs = {name: write_vl_model(root, name, seed=i) for i, name in enumerate(CASES)}
    models = {name: Qwen2VLForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
              for name, d in dirs.items()}
    return dirs, models


def _ids(name):
    c = VL_CASES[name]
    return {"image_token_id": c["image_token_id"], "video_token_id": c["video_token_id"],
            "spatial_merge_size": c["vision_config"]["spatial_merge_size"]}


def _patch_dim(name):
    v = VL_CASES[name]["vision_config"]
    return v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2


def _reference(model, batch, attention_mask="batch"):
    mask = batch["attention_mask"] if attention_mask == "batch" else attention_mask
    return model.model.get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                      image_grid_thw=batch["image_grid_thw"],
                                      video_grid_thw=batch["video_grid_thw"], attention_mask=mask)


@pytest.mark.parametrize("given_types", [True, False], ids=["types", "derived"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("kind", VL_BATCH_KINDS)
@pytest.mark.parametrize("name", CASES)
def test_mrope_positions_match_get_rope_index(hf_vl, name, kind, side, given_types):
    batch = vl_batch(name, kind, seed=3, padding_side=side)
    want_pos, want_delta = _reference(hf_vl[1][name], batch)
    got_pos, got_delta = mrope_positions(
        batch["input_ids"], image_grid_thw=batch["image_grid_thw"], video_grid_thw=batch["video_grid_thw"],
        attention_mask=batch["attention_mask"],
        mm_token_type_ids=batch["mm_token_type_ids"] if given_types else None, **_ids(name))
    assert got_pos.dtype == want_pos.dtype and torch.equal(got_pos, want_pos)
    assert got_delta.dtype == want_delta.dtype and torch.equal(got_delta, want_delta)


def test_mrope_positions_without_attention_mask_and_text_only(hf_vl):
    model = hf_vl[1]["untied"]
    batch = vl_batch("untied", "image_video")
    want = _reference(model, batch, attention_mask=None)
    got = mrope_positions(batch["input_ids"], image_grid_thw=batch["image_grid_thw"],
                          video_grid_thw=batch["video_grid_thw"], **_ids("untied"))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # no vision at all, left padded: 1D positions over the real tokens, zeros on padding, delta 0
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = (ids != 0).long()
    want = model.model.get_rope_index(ids, mm_token_type_ids=torch.zeros_like(ids), attention_mask=mask)
    got = mrope_positions(ids, attention_mask=mask, **_ids("untied"))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("name", CASES)
def test_mrope_positions_packed_match_each_segment(hf_vl, name):
    packed = vl_packed_batch(name, seed=5)
    want = torch.cat([_reference(hf_vl[1][name], seg, attention_mask=None)[0][:, 0]
                      for seg in _segments(packed, name)], dim=1)
    for types in (packed["mm_token_type_ids"], None):
        got = mrope_positions_packed(packed["input_ids"], packed["cu_seqlens"],
                                     image_grid_thw=packed["image_grid_thw"],
                                     video_grid_thw=packed["video_grid_thw"], mm_token_type_ids=types, **_ids(name))
        assert torch.equal(got, want)
    flat = mrope_positions_packed(packed["input_ids"][0], packed["cu_seqlens"], image_grid_thw=packed["image_grid_thw"],
                                  video_grid_thw=packed["video_grid_thw"], **_ids(name))
    assert torch.equal(flat, want)


def test_adjacent_images_are_one_run(hf_vl):
    """Two images with no token between them: transformers groups them as one image and fails on
    the length; mrope_positions refuses them with the numbers. One text token between them is fine."""
    c = VL_CASES["untied"]
    img, start, end = c["image_token_id"], c["vision_start_token_id"], c["vision_end_token_id"]
    grids = torch.tensor([[1, 4, 4], [1, 2, 4]])  # 4 and 2 tokens
    ids = torch.tensor([[5, start] + [img] * 6 + [end, 6]])
    types = (ids == img).long()
    with pytest.raises(RuntimeError):
        hf_vl[1]["untied"].model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grids)
    with pytest.raises(VisionInputError, match=r"image tokens 2\.\.7 of row 0 are 6 tokens but image 0 has grid "
                                               r"\(t, h, w\) = \(1, 4, 4\), i\.e\. 4 tokens"):
        mrope_positions(ids, image_grid_thw=grids, **_ids("untied"))
    ids = torch.tensor([[5, start] + [img] * 4 + [7] + [img] * 2 + [end, 6]])
    types = (ids == img).long()
    want = hf_vl[1]["untied"].model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grids)
    got = mrope_positions(ids, image_grid_thw=grids, **_ids("untied"))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_mrope_positions_run_without_grid():
    ids = torch.tensor([[5, 96, 96, 96, 96, 6]])
    with pytest.raises(VisionInputError, match="is image number 0 but only 0 image grid"):
        mrope_positions(ids, **_ids("untied"))


GRIDS = [[[1, 2, 2]], [[1, 4, 6]], [[2, 4, 4]], [[1, 6, 4], [3, 2, 8], [1, 2, 2]]]


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_vision_positions_and_segments_match_transformers(grid):
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

    grid = torch.tensor(grid)
    want = get_vision_position_ids(grid, 2)
    got = vision_patch_positions(grid, 2)
    assert got.dtype == want.dtype and torch.equal(got, want)
    want = get_vision_cu_seqlens(grid)
    got = vision_cu_seqlens(grid)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert merged_token_counts(grid, 2) == (grid.prod(-1) // 4).tolist()


def _check(name, batch, **override):
    override = dict(override)
    input_ids = override.pop("input_ids", batch["input_ids"])
    args = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
    check_multimodal_inputs(input_ids, **{**args, **override}, **_ids(name), patch_dim=_patch_dim(name))


@pytest.mark.parametrize("kind", VL_BATCH_KINDS)
def test_valid_batches_pass_the_checks(kind):
    for name in CASES:
        _check(name, vl_batch(name, kind))
    packed = vl_packed_batch("tied")
    _check("tied", packed)


ERRORS = [
    ({"image_grid_thw": None}, r"pixel_values were given without image_grid_thw"),
    ({"pixel_values": None}, r"image_grid_thw was given without pixel_values"),
    ({"pixel_values_videos": None}, r"video_grid_thw was given without pixel_values_videos"),
    ({"video_grid_thw": None}, r"pixel_values_videos were given without video_grid_thw"),
    ({"image_grid_thw": torch.tensor([1, 6, 4])}, r"image_grid_thw must be an integer tensor of shape \[n, 3\].*"
                                                  r"got torch.int64 of shape \(3,\)"),
    ({"image_grid_thw": torch.tensor([[1.0, 6.0, 4.0]])}, r"of shape \[n, 3\].*got torch.float32"),
    ({"image_grid_thw": torch.tensor([[0, 6, 4]])}, r"image 0 has grid \(t, h, w\) = \(0, 6, 4\); all must be "
                                                    r"positive"),
    ({"video_grid_thw": torch.tensor([[2, 2, 3]])}, r"video 0 has grid \(t, h, w\) = \(2, 2, 3\): h and w must be "
                                                    r"divisible by spatial_merge_size 2"),
    ({"image_grid_thw": torch.tensor([[1, 6, 6]])}, r"pixel_values has 24 rows but image_grid_thw needs "
                                                    r"sum\(t\*h\*w\) = 36 patches"),
    ({"pixel_values": torch.zeros(24, 47)}, r"pixel_values has 47 columns but a patch holds in_channels \* "
                                            r"temporal_patch_size \* patch_size\*\*2 = 96 values"),
    ({"pixel_values_videos": torch.zeros(16, 96, 1)}, r"pixel_values_videos must be \[patches, 96\], "
                                                      r"got shape \(16, 96, 1\)"),
    # tokens = patches / 4 for any grid, so the token check is reached by dropping a placeholder from input_ids
    ({"input_ids": "drop_video_token"}, r"input_ids hold 3 video tokens \(id 97\) but video_grid_thw gives 4 after "
                                        r"2x2 merging"),
    ({"pixel_values_videos": None, "video_grid_thw": None}, r"input_ids hold 4 video tokens \(id 97\) but no "
                                                            r"pixel_values_videos were given"),
]


@pytest.mark.parametrize(("override", "match"), ERRORS, ids=[m[:40] for _, m in ERRORS])
def test_check_multimodal_inputs_errors(override, match):
    batch = vl_batch("untied", "image_video")  # image (1, 6, 4): 24 patches; video (2, 2, 4): 16 patches
    override = dict(override)
    if override.get("input_ids") == "drop_video_token":
        ids = batch["input_ids"].clone()
        ids[0, (ids[0] == VL_CASES["untied"]["video_token_id"]).nonzero()[0]] = 5
        override["input_ids"] = ids
    with pytest.raises(VisionInputError, match=match):
        _check("untied", batch, **override)


def test_image_tokens_without_pixels():
    batch = vl_batch("untied", "one_image")
    with pytest.raises(VisionInputError, match=r"input_ids hold 4 image tokens \(id 96\) but no pixel_values"):
        _check("untied", batch, pixel_values=None, image_grid_thw=None)


def test_write_vl_model_layout_and_randomization(hf_vl):
    """save_pretrained in transformers 5.23 writes the original checkpoint names (visual.*, model.*,
    lm_head.*), and every parameter is randomized (no norm left at 1, no bias at 0)."""
    from safetensors import safe_open

    dirs, models = hf_vl
    for name, d in dirs.items():
        with safe_open(f"{d}/model.safetensors", "pt") as f:
            keys = set(f.keys())
        assert {k.split(".")[0] for k in keys} == ({"visual", "model"} if VL_CASES[name]["tie_word_embeddings"]
                                                   else {"visual", "model", "lm_head"})
        assert "model.embed_tokens.weight" in keys and "visual.merger.ln_q.bias" in keys
        assert not any(k.startswith(("model.visual.", "model.language_model.")) for k in keys)
        for pname, p in models[name].named_parameters():
            assert p.std() > 0.01, pname
            if ("norm" in pname or ".ln_q." in pname) and pname.endswith(".weight"):
                assert 0.5 <= p.min() and p.max() <= 1.5 and (p - 1).abs().max() > 0.2, pname


def test_transformers_forward_needs_mm_token_type_ids(hf_vl):
    """Why the builders return mm_token_type_ids: transformers' forward refuses grids without them."""
    batch = vl_batch("untied", "one_image")
    batch["mm_token_type_ids"] = None
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        hf_vl[1]["untied"](**batch)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("kind", VL_BATCH_KINDS)
def test_batches_run_through_transformers(hf_vl, kind, side):
    for name in CASES:
        with torch.no_grad():
            out = hf_vl[1][name](**vl_batch(name, kind, padding_side=side))
        assert torch.isfinite(out.loss)


def _segments(packed, name):
    """The packed samples as batches of one (grids and pixel rows split in order)."""
    merge = VL_CASES[name]["vision_config"]["spatial_merge_size"]
    b = packed["cu_seqlens"].tolist()
    out, used = [], {"image": 0, "video": 0}
    for a, z in zip(b, b[1:]):
        types = packed["mm_token_type_ids"][:, a:z]
        seg = {"input_ids": packed["input_ids"][:, a:z], "attention_mask": None,
               "labels": packed["labels"][:, a:z].clone(), "mm_token_type_ids": types}
        for kind, code, pix_key, grid_key in (("image", 1, "pixel_values", "image_grid_thw"),
                                              ("video", 2, "pixel_values_videos", "video_grid_thw")):
            need = int((types == code).sum())
            grids = packed[grid_key] if packed[grid_key] is not None else torch.zeros(0, 3, dtype=torch.long)
            first = used[kind]
            while need > 0:
                need -= int(grids[used[kind]].prod()) // merge**2
                used[kind] += 1
            rows = grids.prod(-1).tolist()
            lo, hi = sum(rows[:first]), sum(rows[:used[kind]])
            n = used[kind] - first
            seg[grid_key] = grids[first:used[kind]] if n else None
            seg[pix_key] = packed[pix_key][lo:hi] if n else None
        out.append(seg)
    return out


@pytest.mark.parametrize("name", CASES)
def test_packed_batch_runs_through_transformers(hf_vl, name):
    """Per segment, and packed in one row with transformers' 4-row position_ids (row 0 the 1D text
    positions from which it builds the block-diagonal mask, rows 1-3 get_rope_index per segment):
    same logits, and the packed loss is the token-weighted mean of the segment losses."""
    model = hf_vl[1][name]
    packed = vl_packed_batch(name, seed=1)
    segments = _segments(packed, name)
    with torch.no_grad():
        outs = [model(**seg) for seg in segments]
        mrope = torch.cat([_reference(model, seg, attention_mask=None)[0] for seg in segments], dim=2)
        text = torch.cat([torch.arange(s["input_ids"].shape[1]) for s in segments]).view(1, 1, -1)
        batch = {k: v for k, v in packed.items() if k != "cu_seqlens"}
        # use_cache=False: with a cache transformers skips the packed-sequence mask and attends across segments
        out = model(**batch, position_ids=torch.cat([text, mrope]), use_cache=False)
    assert all(torch.isfinite(o.loss) for o in outs) and torch.isfinite(out.loss)
    torch.testing.assert_close(out.logits, torch.cat([o.logits for o in outs], dim=1), rtol=1e-4, atol=1e-4)
    counts = [int((s["labels"][:, 1:] != -100).sum()) for s in segments]
    want = sum(o.loss * c for o, c in zip(outs, counts)) / sum(counts)
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-5)
