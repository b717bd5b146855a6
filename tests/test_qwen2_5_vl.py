"""Qwen2.5-VL (windowed vision tower + M-RoPE decoder) against transformers'
``Qwen2_5_VLForConditionalGeneration`` (gloo, CPU, fp32), on the Qwen2-VL harness (tests/workers_vl.py,
tests/vl_cases.py ``VL25_CASES``).

The tiny cases mix window and full-attention vision blocks (``fullatt_block_indexes``) with windows
of 2x2 merged patches, so images of more than 2 merged patches a side run several windows (some cut
short) and the window reordering and its inverse matter; videos carry ``second_per_grid_ts`` whose
``tokens_per_second`` intervals truncate (2.6, 1.5, 1.0 and 32.5, 18.75, 12.5). One group of
processes per world size runs every layout of that size: logits and loss for one image, two images,
a video, image + video, a mixed batch (right and left padding) and a packed batch; two SGD steps with
every vision and text gradient compared; ``save_pretrained`` against the source files bitwise.
M-RoPE positions must be ``torch.equal`` to transformers' ``get_rope_index`` and the window order to
``transformers.vision_utils.get_vision_window_index``.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import records_on_ranks
from tests.vl_cases import (
    VL25_CASES,
    VL_BATCH_KINDS,
    VL_BF16_BOUNDS,
    vl_batch,
    vl_config,
    vl_packed_batch,
    write_vl_model,
)
from tests.workers_vl import _segments, suite

FP32_TOL = 1e-5
GRAD_REL_TOL = 1e-4
ROOT = Path(__file__).resolve().parent.parent

LAYOUTS = {
    1: [("v25_untied", {}), ("v25_tied", {}, {"forward_backward": True, "microbatches": 2}),
        ("v25_untied", {}, {"bf16": True})],
    2: [("v25_tied", {"tp": 2, "sequence_parallel": True}), ("v25_untied", {"tp": 2}),
        ("v25_untied", {"cp": 2, "recompute": "full"}), ("v25_tied", {"ulysses": 2}),
        ("v25_tied", {"fsdp": True}),
        # the tower on the first of two stages, the tied head on the second
        ("v25_tied", {"pp": 2, "num_layers_in_first_pipeline_stage": 1}, {"forward_backward": True}),
        ("v25_tied", {"tp": 2, "sequence_parallel": True}, {"bf16": True})],
}


@pytest.fixture(scope="module")
def vl25_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl25")
    return tuple(sorted((name, write_vl_model(root, name, seed=10 + i)) for i, name in enumerate(VL25_CASES)))


@functools.lru_cache(maxsize=None)
def _records(world: int, dirs: tuple) -> list[tuple]:
    return records_on_ranks(world, suite, dict(dirs), LAYOUTS[world])


METRICS = {"logits": r"logits_.*", "loss": r"loss_.*|step\d_loss.*", "grads": r"grads_.*", "saved": "saved_tensors",
           "bf16": r"bf16_.*"}


def _bf16_worlds() -> set[int]:
    return {w for w, layouts in LAYOUTS.items() for _, _, *options in layouts if options and options[0].get("bf16")}


@pytest.mark.parametrize(("world", "metric"), [(w, m) for w in sorted(LAYOUTS) for m in sorted(METRICS)
                                             if m != "bf16" or w in _bf16_worlds()])
def test_qwen2_5_vl_parity(vl25_dirs, world, metric):
    records = _records(world, vl25_dirs)
    pat = re.compile(METRICS[metric])
    selected = [r for r in records if pat.fullmatch(r[2])]
    if metric in ("loss", "grads"):  # every layout (forward_backward ones have no logits or save records)
        assert {(case, layout) for case, layout, *_ in selected} == {
            (case, layout) for case, layout, *_ in records}, f"layouts without {metric} records"
    assert selected, f"no {metric} records"
    bound = GRAD_REL_TOL if metric == "grads" else 0.0 if metric == "saved" else FP32_TOL
    bad = [f"{case} {layout} {name}={value:.3g}" for case, layout, name, value in selected
           if not value <= VL_BF16_BOUNDS.get(name, bound)]
    assert not bad, "; ".join(bad)


def test_cp_and_ulysses_ranks_share_the_vision_work(vl25_dirs):
    """Each cp/ulysses rank encodes only its share of whole images/videos (windows never cross them)."""
    records = [r for r in _records(2, vl25_dirs) if r[2] == "vision_share"]
    shared = {r[1] for r in records if re.search(r"(cp|ulysses)=2", r[1])}
    assert len(shared) == 2, shared
    for layout in shared:
        shares = [r[3] for r in records if r[1] == layout]
        assert all(share < 1.0 for share in shares) and sum(shares) == pytest.approx(1.0), (layout, shares)


# ------------------------------------------------------------------ positions and windows
@pytest.fixture(scope="module")
def hf25(vl25_dirs):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return {name: Qwen2_5_VLForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
            for name, d in vl25_dirs}


def _ours(name, batch, **extra):
    from models.qwen2_5_vl.positions import mrope_positions

    v = VL25_CASES[name]
    extra = {"tokens_per_second": v["vision_config"]["tokens_per_second"], **extra}
    return mrope_positions(batch["input_ids"], image_grid_thw=batch["image_grid_thw"],
                           video_grid_thw=batch["video_grid_thw"], attention_mask=batch["attention_mask"],
                           mm_token_type_ids=batch["mm_token_type_ids"], image_token_id=v["image_token_id"],
                           video_token_id=v["video_token_id"],
                           spatial_merge_size=v["vision_config"]["spatial_merge_size"], **extra)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("kind", VL_BATCH_KINDS)
@pytest.mark.parametrize("name", sorted(VL25_CASES))
def test_mrope_positions_match_get_rope_index(hf25, name, kind, side):
    """Video temporal positions scaled by tokens_per_second x second_per_grid_ts (and by
    tokens_per_second alone without it), truncated as transformers does: ``torch.equal``."""
    batch = vl_batch(name, kind, seed=3, padding_side=side)
    model = hf25[name].model
    for seconds in ({"second_per_grid_ts": batch.get("second_per_grid_ts")}, {}):
        want = model.get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                    image_grid_thw=batch["image_grid_thw"], video_grid_thw=batch["video_grid_thw"],
                                    attention_mask=batch["attention_mask"], **seconds)
        got = _ours(name, batch, **seconds)
        assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0]), seconds
        assert torch.equal(got[1], want[1])
    if batch.get("video_grid_thw") is not None:  # the scaling is exercised: Qwen2-VL's step of 1 differs
        assert not torch.equal(_ours(name, batch, second_per_grid_ts=batch["second_per_grid_ts"])[0],
                               _ours(name, batch, tokens_per_second=None)[0])


@pytest.mark.parametrize("name", sorted(VL25_CASES))
def test_mrope_positions_packed_match_each_segment(hf25, name):
    from models.qwen2_5_vl.positions import mrope_positions_packed

    packed = vl_packed_batch(name, seed=5)
    v = VL25_CASES[name]
    want = []
    for seg in _segments(packed, hf25[name].config):
        want.append(hf25[name].model.get_rope_index(
            seg["input_ids"], mm_token_type_ids=seg["mm_token_type_ids"], image_grid_thw=seg.get("image_grid_thw"),
            video_grid_thw=seg.get("video_grid_thw"), second_per_grid_ts=seg.get("second_per_grid_ts"))[0][:, 0])
    got = mrope_positions_packed(packed["input_ids"], packed["cu_seqlens"], image_grid_thw=packed["image_grid_thw"],
                                 video_grid_thw=packed["video_grid_thw"], image_token_id=v["image_token_id"],
                                 video_token_id=v["video_token_id"],
                                 spatial_merge_size=v["vision_config"]["spatial_merge_size"],
                                 tokens_per_second=v["vision_config"]["tokens_per_second"],
                                 second_per_grid_ts=packed["second_per_grid_ts"])
    assert torch.equal(got, torch.cat(want, dim=1))


GRIDS = [[[1, 2, 2]], [[1, 4, 6]], [[2, 4, 4]], [[1, 6, 4], [3, 2, 8], [1, 2, 2]], [[1, 10, 14], [2, 6, 6]]]


@pytest.mark.parametrize("window_tokens", [1, 2, 3])
@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_window_index_matches_transformers(grid, window_tokens):
    from transformers.vision_utils import get_vision_window_index

    from models.qwen2_5_vl.positions import vision_window_index

    grid = torch.tensor(grid)
    want_index, want_cu = get_vision_window_index(grid, spatial_merge_size=2, window_size=window_tokens * 2 * 14,
                                                  patch_size=14)
    index, bounds = vision_window_index(grid, 2, window_tokens)
    assert index.dtype == want_index.dtype and torch.equal(index, want_index)
    assert torch.equal(torch.tensor(bounds, dtype=torch.int32), want_cu)


def test_second_per_grid_ts_must_hold_one_value_per_video(vl25_dirs):
    from models.qwen2_5_vl import build_parallel_model
    from models.qwen2_5_vl.positions import VisionInputError
    from models.qwen2_vl import build_parallel_model as build_qwen2_vl

    model = build_parallel_model(dict(vl25_dirs)["v25_untied"])
    batch = {k: v for k, v in vl_batch("v25_untied", "image_video").items() if v is not None}
    with pytest.raises(VisionInputError, match=r"second_per_grid_ts has shape \(2,\) but video_grid_thw gives 1 "
                                               r"video\(s\)"):
        model(**{**batch, "second_per_grid_ts": torch.tensor([0.5, 1.0])})
    qwen2_vl = build_qwen2_vl(vl_config({**VL25_CASES["v25_untied"], "vision_config": {
        "depth": 1, "embed_dim": 64, "hidden_size": 64, "num_heads": 4, "patch_size": 4}}))
    with pytest.raises(VisionInputError, match="second_per_grid_ts was given but this model's temporal positions"):
        qwen2_vl(**batch)


# ------------------------------------------------------------------ checkpoints, config, pmz
def _memory_layout(src: Path, dst: Path) -> dict:
    """A copy of ``src`` saved under transformers' in-memory names; returns the on-disk tensors."""
    from safetensors.torch import load_file, save_file

    on_disk = load_file(str(src / "model.safetensors"))
    shutil.copytree(src, dst)
    save_file({("model.visual." + n[len("visual."):]) if n.startswith("visual.")
               else ("model.language_model." + n[len("model."):]) if n.startswith("model.") else n: t
               for n, t in on_disk.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return on_disk


def test_transformers_writes_the_release_layout_and_both_layouts_load_the_same(vl25_dirs, tmp_path):
    from models.qwen2_5_vl import build_parallel_model

    src = Path(dict(vl25_dirs)["v25_untied"])
    on_disk = _memory_layout(src, tmp_path / "memory")
    assert {n.split(".")[0] for n in on_disk} == {"visual", "model", "lm_head"}, "transformers' on-disk layout changed"
    assert "visual.blocks.0.mlp.gate_proj.bias" in on_disk and "visual.blocks.0.norm1.bias" not in on_disk
    a, b = build_parallel_model(src), build_parallel_model(tmp_path / "memory")
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)


@pytest.mark.parametrize("copy_path", ["1", "0"])
def test_pmz_convert_hf_to_hf_writes_transformers_layout_from_either(vl25_dirs, tmp_path, monkeypatch, copy_path):
    """``pmz convert --to hf`` of either key layout, copy path and torch path: transformers' tensors
    under its on-disk names, bitwise; transformers loads the result."""
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    import converters.copy_path.hf
    from converters.engine import convert

    monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
    copied = []
    writer = converters.copy_path.hf.write_hf_by_copy
    monkeypatch.setattr(converters.copy_path.hf, "write_hf_by_copy",
                        lambda *a, **k: copied.append(1) or writer(*a, **k))
    src = Path(dict(vl25_dirs)["v25_tied"])
    on_disk = _memory_layout(src, tmp_path / "memory")
    for name, source in (("from_disk", src), ("from_memory", tmp_path / "memory")):
        out = convert(source, tmp_path / name, to="hf", max_shard_size=20000, workers=2)
        got = {}
        for f in sorted(out.glob("*.safetensors")):
            got.update(load_file(str(f)))
        assert got.keys() == on_disk.keys(), sorted(set(got) ^ set(on_disk))[:6]
        assert all(torch.equal(got[k], on_disk[k]) for k in on_disk), name
    assert len(copied) == (2 if copy_path == "1" else 0), "the path taken is not the one asked for"
    loaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "from_memory"), dtype=torch.float32)
    assert torch.equal(loaded.model.visual.blocks[1].mlp.up_proj.bias, on_disk["visual.blocks.1.mlp.up_proj.bias"])


def test_pmz_reads_qwen2_5_vl_configs_as_transformers_does(vl25_dirs, tmp_path):
    """config.json read without transformers (``pmz``): transformers 5's text_config layout and the
    release layout (text fields at the top level, ``rope_scaling: {"type": "mrope"}``, ``in_chans``, no
    ``tokens_per_second``/``fullatt_block_indexes`` so transformers' defaults apply) give the model
    config transformers' own parsing gives."""
    from transformers import AutoConfig

    from converters.formats.hf_config import read_hf_config
    from converters.layout.model import architecture_for
    from models.qwen2_5_vl.config import model_config

    dirs = [Path(d) for _, d in vl25_dirs]
    release = tmp_path / "release_layout"
    shutil.copytree(dirs[0], release)
    data = json.loads((release / "config.json").read_text())
    text = data.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    data.update(text, rope_theta=rope["rope_theta"],
                rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    vision = data["vision_config"]
    vision["in_chans"] = vision.pop("in_channels")
    for key in ("tokens_per_second", "fullatt_block_indexes", "rope_parameters"):
        vision.pop(key)
    vision["depth"] = 8  # transformers' default full-attention blocks (7, 15, 23, 31) need not exist
    (release / "config.json").write_text(json.dumps(data))
    for directory in [*dirs, release]:
        ours = architecture_for("qwen2_5_vl", str(directory)).model_config(read_hf_config(directory))
        assert ours == model_config(AutoConfig.from_pretrained(str(directory))), directory.name
    assert ours.vision.tokens_per_second == 4 and ours.vision.fullatt_block_indexes == (7, 15, 23, 31)


BAD_CONFIGS = [
    ({"vision_config": {"window_size": 20}}, r"vision_config\.window_size=20 is not a positive multiple of the merged "
                                             r"patch size spatial_merge_size x patch_size = 2 x 4 = 8"),
    ({"vision_config": {"window_size": 0}}, r"vision_config\.window_size=0 is not a positive multiple of the merged "
                                            r"patch size .* = 8"),
    ({"vision_config": {"hidden_act": "gelu_pytorch_tanh"}},
     r"vision_config\.hidden_act='gelu_pytorch_tanh' is not supported \(quick_gelu, gelu, silu\)"),
    ({"text_config": {"use_sliding_window": True}}, r"qwen2_5_vl: .*use_sliding_window"),
]


@pytest.mark.parametrize(("change", "match"), BAD_CONFIGS, ids=[m[:30] for _, m in BAD_CONFIGS])
def test_fields_not_computed_are_refused_in_one_line(vl25_dirs, tmp_path, change, match):
    """Refused by the builder before any group or collective; the window size by ``pmz convert`` and
    ``pmz inspect`` in one line too (exit 1, nothing written)."""
    from models.common.config import UnsupportedConfigError
    from models.qwen2_5_vl import build_parallel_model

    src = tmp_path / "src"
    shutil.copytree(dict(vl25_dirs)["v25_untied"], src)
    data = json.loads((src / "config.json").read_text())
    for section, fields in change.items():
        data[section].update(fields)
    (src / "config.json").write_text(json.dumps(data))
    with pytest.raises(UnsupportedConfigError, match=match):
        build_parallel_model(src)
    if "window_size=20" not in match:  # pmz's one-line refusal once (a CLI start costs seconds)
        return
    for argv in (["convert", str(src), str(tmp_path / "out" / "x"), "--to", "vllm"], ["inspect", str(src)]):
        proc = subprocess.run([sys.executable, "-m", "converters.cli", *argv], capture_output=True, text=True,
                              cwd=str(ROOT), timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
        assert re.search(match, lines[0]), lines[0]
    assert not (tmp_path / "out").exists()


def test_megatron_targets_and_bad_vllm_layouts_are_refused(vl25_dirs, tmp_path):
    from models.common.export import ExportError
    from models.qwen2_5_vl import build_parallel_model

    model = build_parallel_model(dict(vl25_dirs)["v25_untied"])
    with pytest.raises(ExportError, match="vision num_heads=4 is not divisible by tp=8"):
        model.save_vllm_sharded_state(tmp_path / "vllm", tp=8)
    assert not (tmp_path / "vllm").exists()
    for target in ("megatron", "megatron-dist"):
        proc = subprocess.run([sys.executable, "-m", "converters.cli", "convert", dict(vl25_dirs)["v25_untied"],
                               str(tmp_path / target), "--to", target], capture_output=True, text=True, cwd=str(ROOT))
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "qwen2_5_vl has no Megatron layout yet" in proc.stderr, proc.stderr
        assert not (tmp_path / target).exists()


def test_pmz_inspect_and_verify_logits_know_qwen2_5_vl(vl25_dirs, tmp_path):
    """``pmz inspect`` names the architecture; ``pmz verify --logits`` runs transformers' own model on a
    prompt with an image: a bitwise copy gives 0, a change in one windowed vision block moves the logits."""
    from safetensors.torch import load_file, save_file

    from converters.engine import convert
    from converters.verify import verify

    src = Path(dict(vl25_dirs)["v25_untied"])
    proc = subprocess.run([sys.executable, "-m", "converters.cli", "inspect", str(src)], capture_output=True,
                          text=True, cwd=str(ROOT), timeout=120)
    assert proc.returncode == 0 and re.search(r"architecture\s+qwen2_5_vl", proc.stdout), proc.stdout + proc.stderr
    copy = convert(src, tmp_path / "copy", to="hf")
    report = verify(str(src), str(copy), logits=True)
    assert report.ok and report.logits_diff == 0.0, report.mismatched
    changed = tmp_path / "changed"
    shutil.copytree(src, changed)
    state = load_file(str(changed / "model.safetensors"))
    state["visual.blocks.0.mlp.up_proj.weight"] = state["visual.blocks.0.mlp.up_proj.weight"] + 0.05
    save_file(state, str(changed / "model.safetensors"), metadata={"format": "pt"})
    report = verify(str(src), str(changed), logits=True)
    assert report.logits_diff > 1e-4, report.logits_diff
    assert [m.split(":")[0] for m in report.mismatched] == ["visual.blocks.0.mlp.up_proj.weight", "logits"]
