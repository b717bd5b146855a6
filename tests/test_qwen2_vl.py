"""Qwen2-VL (vision tower + M-RoPE decoder) against transformers' Qwen2VLForConditionalGeneration
(gloo, CPU, fp32).

One group of processes per world size runs every layout of that size; each rank compares with a
transformers model built from the same directory: logits and loss for one image, two images of
different grids, a video, image + video, a mixed batch with a text-only row (right and left
padding) and a packed batch; two SGD steps with every vision and text gradient compared; then
``save_pretrained`` against the source files (names and bytes).
"""

from __future__ import annotations

import functools
import re

import pytest

from tests.distributed import records_on_ranks, run_distributed
from tests.vl_cases import VL_BF16_BOUNDS, VL_CASES, vl_bf16_bound, write_vl_model
from tests.workers_vl import bad_input_messages, dp_text_and_image_ranks, suite

FP32_TOL = 1e-5
GRAD_REL_TOL = 1e-4

LAYOUTS = {
    1: [("untied", {}), ("tied", {}), ("untied", {}, {"forward_backward": True, "microbatches": 2}),
        ("untied", {}, {"bf16": True})],
    2: [("untied", {"tp": 2}), ("tied", {"tp": 2, "sequence_parallel": True}), ("untied", {"cp": 2}),
        ("tied", {"ulysses": 2}),
        # the tower on the first of two stages; tied embedding and head on different stages
        ("tied", {"pp": 2, "num_layers_in_first_pipeline_stage": 1}, {"forward_backward": True}),
        ("tied", {"ulysses": 2}, {"forward_backward": True}),
        ("tied", {"tp": 2, "sequence_parallel": True}, {"bf16": True})],
    4: [("untied", {"tp": 4, "sequence_parallel": True}),
        ("untied", {"tp": 2, "pp": 2, "sequence_parallel": True}, {"forward_backward": True, "microbatches": 4}),
        ("untied", {"tp": 2, "cp": 2, "sequence_parallel": True}),
        ("untied", {"tp": 2, "cp": 2, "sequence_parallel": True}, {"forward_backward": True})],
}


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    return tuple(sorted((name, write_vl_model(root, name, seed=i)) for i, name in enumerate(VL_CASES)))


@functools.lru_cache(maxsize=None)
def _records(world: int, dirs: tuple) -> list[tuple]:
    return records_on_ranks(world, suite, dict(dirs), LAYOUTS[world])


METRICS = {"logits": r"logits_.*", "loss": r"loss_.*|step\d_loss.*", "grads": r"grads_.*", "saved": "saved_tensors",
           "bf16": r"bf16_.*"}


def _bf16_worlds() -> set[int]:
    return {w for w, layouts in LAYOUTS.items() for _, _, *options in layouts if options and options[0].get("bf16")}


@pytest.mark.parametrize(("world", "metric"), [(w, m) for w in sorted(LAYOUTS) for m in sorted(METRICS)
                                             if m != "bf16" or w in _bf16_worlds()])
def test_qwen2_vl_parity(vl_dirs, world, metric):
    records = _records(world, vl_dirs)
    pat = re.compile(METRICS[metric])
    selected = [r for r in records if pat.fullmatch(r[2])]
    if metric in ("loss", "grads"):  # every layout (forward_backward ones have no logits or save records)
        assert {(case, layout) for case, layout, *_ in selected} == {
            (case, layout) for case, layout, *_ in records}, f"layouts without {metric} records"
    assert selected, f"no {metric} records"
    bound = GRAD_REL_TOL if metric == "grads" else 0.0 if metric == "saved" else FP32_TOL
    bad = [f"{case} {layout} {name}={value:.3g}" for case, layout, name, value in selected
           if not value <= (vl_bf16_bound(name, layout) if name in VL_BF16_BOUNDS else bound)]
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_and_ulysses_ranks_share_the_vision_work(vl_dirs, world):
    """Each cp/ulysses rank encodes only its share of the images (whole images, by patch count); the
    shares of a TP slot's sequence ranks add up to every patch once (TP ranks encode the same share)."""
    records = [r for r in _records(world, vl_dirs) if r[2] == "vision_share"]
    for layout in {r[1] for r in records if re.search(r"(cp|ulysses)=2", r[1])}:
        shares = [r[3] for r in records if r[1] == layout]
        tp = int(re.search(r"tp=(\d+)", layout).group(1))
        assert all(share < 1.0 for share in shares), (layout, shares)
        assert sum(shares) == pytest.approx(tp), (layout, shares)
    for layout in {r[1] for r in records if not re.search(r"(cp|ulysses)=2", r[1])}:
        assert all(r[3] == 1.0 for r in records if r[1] == layout), layout


def test_both_hf_key_layouts_load_the_same_model(vl_dirs, tmp_path):
    """transformers' in-memory layout (model.language_model.*, model.visual.*) and the on-disk one
    it writes (model.*, visual.*) are the same checkpoint; a file holding one weight under both is refused."""
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    from models.common.sources import CheckpointError
    from models.qwen2_vl import build_parallel_model

    src = Path(dict(vl_dirs)["untied"])
    on_disk = load_file(str(src / "model.safetensors"))
    memory_layout = ("model.language_model.", "model.visual.")
    assert any(n.startswith("visual.") for n in on_disk), "transformers' on-disk layout changed"
    assert not any(n.startswith(memory_layout) for n in on_disk), "transformers' on-disk layout changed"
    renamed = {("model.visual." + n[len("visual."):]) if n.startswith("visual.")
               else ("model.language_model." + n[len("model."):]) if n.startswith("model.") else n: t
               for n, t in on_disk.items()}
    other = tmp_path / "memory_layout"
    shutil.copytree(src, other)
    save_file(renamed, str(other / "model.safetensors"), metadata={"format": "pt"})
    a, b = build_parallel_model(src), build_parallel_model(other)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    both = tmp_path / "both_layouts"
    shutil.copytree(src, both)
    save_file({**on_disk, "model.visual.merger.ln_q.bias": on_disk["visual.merger.ln_q.bias"].clone()},
              str(both / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"visual\.merger\.ln_q\.bias and visual\.merger\.ln_q\.bias|"
                                              r"model\.visual\.merger\.ln_q\.bias.*same weight"):
        build_parallel_model(both)


def test_bad_vision_inputs_are_refused_on_every_rank_before_any_collective(vl_dirs):
    per_rank = run_distributed(2, bad_input_messages, dict(vl_dirs)["untied"], {"tp": 2, "sequence_parallel": True})
    expected = [r"input_ids hold 3 image tokens .* image_grid_thw gives 4 after 2x2 merging",
                r"image 0 has grid \(t, h, w\) = \(1, 3, 4\): h and w must be divisible by spatial_merge_size 2",
                r"pixel_values has 15 rows but image_grid_thw needs sum\(t\*h\*w\) = 16 patches",
                r"pixel_values has 97 columns but a patch holds .* = 96 values"]
    for messages in per_rank:
        assert len(messages) == 4 and "no error" not in messages, messages
        for message, pattern in zip(messages, expected):
            assert re.search(pattern, message), message


def test_bad_vllm_layout_and_megatron_targets_are_refused_for_qwen2_vl(vl_dirs, tmp_path):
    """vLLM's vision tower is tensor-parallel too: a TP its heads do not divide is refused before any
    write, naming the numbers; Megatron formats (no Megatron names for the tower yet) are refused by
    ``pmz convert`` in one line with nothing written."""
    import subprocess
    import sys
    from pathlib import Path

    from models.common.export import ExportError
    from models.qwen2_vl import build_parallel_model

    model = build_parallel_model(dict(vl_dirs)["untied"])
    with pytest.raises(ExportError, match="vision num_heads=4 is not divisible by tp=8"):
        model.save_vllm_sharded_state(tmp_path / "vllm", tp=8)
    assert not (tmp_path / "vllm").exists()
    root = Path(__file__).resolve().parent.parent
    for target in ("megatron", "megatron-dist"):
        proc = subprocess.run([sys.executable, "-m", "converters.cli", "convert", dict(vl_dirs)["untied"],
                               str(tmp_path / target), "--to", target], capture_output=True, text=True, cwd=str(root))
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "qwen2_vl has no Megatron layout yet" in proc.stderr, proc.stderr
        assert not (tmp_path / target).exists()


@pytest.mark.parametrize("copy_path", ["1", "0"])
def test_pmz_convert_hf_to_hf_writes_transformers_layout_from_either(vl_dirs, tmp_path, monkeypatch, copy_path):
    """``pmz convert --to hf`` of a Qwen2-VL directory in either key layout (the copy path and the
    torch path) writes the tensors transformers' ``save_pretrained`` wrote, under its names, bitwise."""
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    import converters.copy_path.hf
    from converters.engine import convert

    monkeypatch.setenv("PMZ_COPY_PATH", copy_path)
    copied = []  # the copy path's HF writer, called once per conversion it takes
    writer = converters.copy_path.hf.write_hf_by_copy
    monkeypatch.setattr(converters.copy_path.hf, "write_hf_by_copy",
                        lambda *a, **k: copied.append(1) or writer(*a, **k))
    src = Path(dict(vl_dirs)["tied"])
    on_disk = load_file(str(src / "model.safetensors"))
    memory = tmp_path / "memory_layout"
    shutil.copytree(src, memory)
    save_file({("model.visual." + n[len("visual."):]) if n.startswith("visual.")
               else ("model.language_model." + n[len("model."):]) if n.startswith("model.") else n: t
               for n, t in on_disk.items()}, str(memory / "model.safetensors"), metadata={"format": "pt"})
    for name, source in (("from_disk_layout", src), ("from_memory_layout", memory)):
        out = convert(source, tmp_path / name, to="hf", max_shard_size=20000, workers=2)
        got = {}
        for f in sorted(out.glob("*.safetensors")):
            got.update(load_file(str(f)))
        assert got.keys() == on_disk.keys(), sorted(set(got) ^ set(on_disk))[:6]
        assert all(torch.equal(got[k], on_disk[k]) for k in on_disk), name
        assert len(list(out.glob("*.safetensors"))) > 1 and (out / "model.safetensors.index.json").exists()
    assert len(copied) == (2 if copy_path == "1" else 0), "the path taken is not the one asked for"
    from transformers import Qwen2VLForConditionalGeneration

    loaded = Qwen2VLForConditionalGeneration.from_pretrained(str(tmp_path / "from_memory_layout"), dtype=torch.float32)
    assert torch.equal(loaded.model.visual.blocks[0].attn.qkv.weight, on_disk["visual.blocks.0.attn.qkv.weight"])


def test_dp_rank_without_images_reduces_the_same_gradients(vl_dirs):
    """A DP rank whose batch has no image still joins the tower's gradient reduction (zeros)."""
    per_rank = run_distributed(2, dp_text_and_image_ranks, dict(vl_dirs)["untied"])
    for records in per_rank:
        assert records and all(value <= GRAD_REL_TOL for *_, value in records), records


def test_pmz_reads_qwen2_vl_configs_as_transformers_does(vl_dirs, tmp_path):
    """``pmz`` reads config.json without transformers: for transformers 5's ``text_config`` layout and
    for the older top-level one (``rope_scaling: {"type": "mrope"}``, ``in_chans``) it must derive the
    model config transformers' own parsing gives."""
    import json
    import shutil
    from pathlib import Path

    from transformers import AutoConfig

    from converters.formats.hf_config import read_hf_config
    from converters.layout.model import architecture_for
    from models.qwen2_vl.config import model_config

    dirs = [Path(d) for _, d in vl_dirs]
    older = tmp_path / "older_layout"
    shutil.copytree(dirs[0], older)
    data = json.loads((older / "config.json").read_text())
    text = data.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    data.update(text, rope_theta=rope["rope_theta"],
                rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    data["vision_config"]["in_chans"] = data["vision_config"].pop("in_channels")
    (older / "config.json").write_text(json.dumps(data))
    pre_v5 = tmp_path / "tie_flag_in_text_config"  # tied, flag where saves before transformers 5 put it
    shutil.copytree(dirs[0] if json.loads((dirs[0] / "config.json").read_text())["tie_word_embeddings"] else dirs[1],
                    pre_v5)
    data = json.loads((pre_v5 / "config.json").read_text())
    data["text_config"]["tie_word_embeddings"] = data.pop("tie_word_embeddings")
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        data.pop(key)  # transformers' defaults apply
    (pre_v5 / "config.json").write_text(json.dumps(data))
    for directory in [*dirs, older, pre_v5]:
        ours = architecture_for("qwen2_vl", str(directory)).model_config(read_hf_config(directory))
        assert ours == model_config(AutoConfig.from_pretrained(str(directory))), directory.name
    assert architecture_for("qwen2_vl", "x").model_config(read_hf_config(pre_v5)).tie_word_embeddings


@pytest.mark.parametrize("depth", [10**9, 1])
def test_vision_depth_is_checked_against_the_blocks_present_before_any_table(vl_dirs, tmp_path, depth):
    """A config.json whose ``vision_config.depth`` disagrees with the ``visual.blocks.N`` tensors (an
    absurd 10^9, or fewer blocks than stored) fails in one line naming config.json, the number and the
    blocks found, within a 4 GiB address-space limit (the weight map lists vision blocks one by one),
    and writes nothing; ``pmz inspect`` says the same."""
    import json
    import resource
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    src = tmp_path / "src"
    shutil.copytree(dict(vl_dirs)["untied"], src)
    data = json.loads((src / "config.json").read_text())
    stored = data["vision_config"]["depth"]
    data["vision_config"]["depth"] = depth
    (src / "config.json").write_text(json.dumps(data))
    root = Path(__file__).resolve().parents[1]

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    for argv in (["convert", str(src), str(tmp_path / "out" / "x"), "--to", "hf"], ["inspect", str(src)]):
        proc = subprocess.run([sys.executable, "-m", "converters.cli", *argv], capture_output=True, text=True,
                              cwd=str(root), preexec_fn=limit_memory, timeout=120)
        assert proc.returncode == 1, (argv[0], proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr[-2000:]
        assert str(src / "config.json") in lines[0] and f"vision_config.depth={depth}" in lines[0], lines[0]
        assert f"{stored} layer(s) (visual.blocks.0..{stored - 1})" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_pmz_verify_logits_runs_qwen2_vl_with_an_image(vl_dirs, tmp_path):
    """``pmz verify --logits`` on Qwen2-VL runs transformers' own model on a prompt with an image: a
    bitwise copy gives identical logits, and a change in a vision block alone moves them."""
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    from converters.engine import convert
    from converters.verify import verify

    src = Path(dict(vl_dirs)["untied"])
    copy = convert(src, tmp_path / "copy", to="hf")
    report = verify(str(src), str(copy), logits=True)
    assert report.ok and report.logits_diff == 0.0, report.mismatched
    changed = tmp_path / "changed"
    shutil.copytree(src, changed)
    state = load_file(str(changed / "model.safetensors"))
    state["visual.blocks.0.mlp.fc1.weight"] = state["visual.blocks.0.mlp.fc1.weight"] + 0.05
    save_file(state, str(changed / "model.safetensors"), metadata={"format": "pt"})
    report = verify(str(src), str(changed), logits=True)
    assert report.logits_diff > 1e-4, report.logits_diff  # the image went through the tower
    assert [m.split(":")[0] for m in report.mismatched] == ["visual.blocks.0.mlp.fc1.weight", "logits"]
    assert torch.equal(load_file(str(copy / "model.safetensors"))["visual.merger.mlp.0.weight"],
                       state["visual.merger.mlp.0.weight"])
