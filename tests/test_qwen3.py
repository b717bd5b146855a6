"""Qwen3 and Qwen3-MoE against transformers' ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` (and peft for
LoRA), fp32, on the existing harnesses (tests/workers*.py) run in one 2-rank gloo group:

  * TP2 without and with SP (one KV head: tp > kv heads; head_dim decoupled from hidden/heads; tied and
    untied; attention bias): logits, loss, gradients of every HF tensor (q/k norms included) over two
    SGD steps; packed (unequal lengths) equal to padded and to transformers; bf16 within the dense
    models' documented bounds;
  * dp2 (TP1), cp2 (ring, all-gather), ulysses2 with recompute, FSDP2: padded and packed ``model(...)``,
    one backward, already-sliced input, two ``forward_backward`` steps, log-probs;
  * PP2 (1F1B) and PP2 x VPP2 (interleaved 1F1B): two ``forward_backward`` steps, log-probs;
  * LoRA at TP2+SP on every linear module against peft (logits, LoRA gradients, saved adapter, merge);
  * Qwen3-MoE at dp2 (TP1), EP2, TP2, TP2+SP, EP2 with recompute, cp2 (ring), ulysses2 with recompute,
    FSDP2, EP2 with micro-batches, cp2 (all-gather) x EP2 with micro-batches and PP2 x VPP2 through
    ``forward_backward``: logits, loss with transformers' load-balancing loss, router logits, padded
    batch, gradients over two steps, ``save_pretrained`` bitwise; LoRA on its attention at EP2 against peft.
Bad Qwen3 input (config fields not computed, q/k norm tensors missing or mis-sized) is refused in one
line before any process group.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.distributed import run_distributed
from tests.workers_qwen3 import qwen3_suite

FP32_TOL = 1e-5
GRAD_REL_TOL = 1e-4

PLAN = [
    ("parity", "qwen3_untied", False), ("parity", "qwen3_tied_kv1", True), ("parity", "qwen3_tied_kv1", False),
    ("packed", "qwen3_untied", True), ("packed", "qwen3_tied_kv1", False), ("bf16", "qwen3_untied", True),
    ("long", "qwen3_untied", {}), ("long", "qwen3_untied", dict(cp=2)),
    ("long", "qwen3_tied_kv1", dict(cp=2, cp_comm="allgather")),
    ("long", "qwen3_tied_kv1", dict(ulysses=2, recompute="full")), ("long", "qwen3_untied", dict(fsdp=True)),
    ("pipeline", "qwen3_untied", dict(pp=2), "1f1b", 2),
    ("pipeline", "qwen3_untied", dict(pp=2, vpp=2), "interleaved_1f1b", 2),
    ("lora", "qwen3_untied", "ADAPTER", dict(tp=2, sequence_parallel=True)),
    ("moe", "qwen3moe_norm", {}), ("moe", "qwen3moe_norm", {"ep": 2}), ("moe", "qwen3moe_step2", {"tp": 2}),
    ("moe", "qwen3moe_norm", {"tp": 2, "sequence_parallel": True}),
    ("moe", "qwen3moe_step2", {"ep": 2, "recompute": "full"}),
    ("moe", "qwen3moe_norm", {"ep": 2}, {"microbatches": 2}), ("moe", "qwen3moe_step2", {"pp": 2, "vpp": 2}),
    # the sequence split (aux loss over every rank's tokens), FSDP2, and LoRA on a MoE model's attention
    ("moe", "qwen3moe_norm", {"cp": 2}), ("moe", "qwen3moe_step2", {"ulysses": 2, "recompute": "full"}),
    ("moe", "qwen3moe_norm", {"fsdp": True}),
    ("moe", "qwen3moe_step2", {"cp": 2, "ep": 2, "cp_comm": "allgather"}, {"microbatches": 2}),
    ("lora", "qwen3moe_norm", "MOE_ADAPTER", dict(ep=2)),
]


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory):
    from tests.cases import qwen3_configs, write_hf_model
    from tests.workers_lora import TARGETS, make_adapter

    root = tmp_path_factory.mktemp("qwen3")
    dirs = {name: str(write_hf_model(root, name, cfg, seed=i)) for i, (name, cfg) in enumerate(qwen3_configs().items())}
    adapter = root / "lora" / "adapter"
    make_adapter(dirs["qwen3_untied"], str(adapter), TARGETS)
    moe_adapter = root / "lora" / "moe_adapter"  # attention only: LoRA on experts is refused
    make_adapter(dirs["qwen3moe_norm"], str(moe_adapter), ["q_proj", "k_proj", "v_proj", "o_proj"])
    return dirs, {"ADAPTER": str(adapter), "MOE_ADAPTER": str(moe_adapter)}


@pytest.fixture(scope="module")
def records(qwen3_dirs):
    dirs, adapters = qwen3_dirs
    plan = [tuple(adapters.get(a, a) if isinstance(a, str) else a for a in item) for item in PLAN]
    return [r for rank in run_distributed(2, qwen3_suite, dirs, plan) for r in rank]


def _bound(kind: str, metric: str) -> tuple[str, float]:
    if kind in ("parity", "packed", "bf16"):
        from tests.test_tp_parity import _limit

        return _limit(metric)
    if kind == "lora":
        from tests.test_lora import BOUNDS

        return "max", BOUNDS[metric]
    if kind == "moe":
        from tests.test_moe import _bound as moe_bound

        return moe_bound(metric)
    return "max", GRAD_REL_TOL if "grads" in metric else FP32_TOL


@pytest.mark.parametrize("kind", ["parity", "packed", "bf16", "long", "pipeline", "lora", "moe"])
def test_qwen3_matches_transformers(records, kind):
    selected = [r for r in records if r[0] == kind]
    planned = {(item[1], item[0]) for item in PLAN if item[0] == kind}
    assert {(r[1], r[0]) for r in selected} == planned, "cases without records"
    bad = []
    for _, case, layout, metric, value in selected:
        sense, bound = _bound(kind, metric)
        if (sense == "max" and not value <= bound) or (sense == "min" and not value >= bound):
            bad.append(f"{case} {layout} {metric}={value:.6g} ({sense} {bound})")
    assert not bad, "\n".join(bad)


def test_qwen3_layouts_all_ran(records):
    """Every planned layout produced gradient records (a layout silently skipped would pass above)."""
    layouts = {(r[0], r[1], r[2]) for r in records if r[3].startswith(("grads_step", "model_call_grads"))
               or r[3] == "lora_grads_vs_peft"}
    assert len(layouts) >= len([p for p in PLAN if p[0] not in ("packed", "bf16")]), sorted(layouts)


def _pmz(capsys, *argv) -> tuple[int, list[str]]:
    """``pmz`` in-process: exit code and the lines it wrote to stderr."""
    from converters.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err.strip().splitlines()


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_bad_qwen3_checkpoints_refused_in_one_line(qwen3_dirs, tmp_path, capsys):
    """q/k norm tensor missing or of the wrong size: build_parallel_model raises before any process group,
    and ``pmz convert`` (HF and vLLM targets) exits 1 with one line naming the file, tensor and numbers,
    writing nothing."""
    from models.common.sources import CheckpointError
    from models.qwen3 import build_parallel_model

    src = Path(qwen3_dirs[0]["qwen3_untied"])
    name = "model.layers.1.self_attn.k_norm.weight"
    missing = _edited_copy(src, tmp_path / "missing", lambda t: t.pop(name))
    short = _edited_copy(src, tmp_path / "short", lambda t: t.update({name: t[name][:20].clone()}))
    with pytest.raises(CheckpointError, match=rf"missing tensor.*{re.escape(name)}"):
        build_parallel_model(missing)
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} \(20,\) \(expected \(24,\)\) in model\.safetensors"):
        build_parallel_model(short)
    for bad, words in ((missing, [str(missing), "missing tensor", name]),
                       (short, [str(short), name, "(20,) (expected (24,)) in model.safetensors"])):
        for to in ("hf", "vllm"):
            out = tmp_path / f"out_{bad.name}_{to}"
            rc, lines = _pmz(capsys, "convert", bad, out, "--to", to)
            assert rc == 1 and len(lines) == 1, lines
            assert all(w in lines[0] for w in words), lines[0]
            assert not out.exists() and not list(tmp_path.glob(f".out_{bad.name}_{to}*"))


@pytest.mark.parametrize("field,value,words", [
    ("use_sliding_window", True, "use_sliding_window=True"),
    ("layer_types", ["full_attention", "sliding_attention", "full_attention", "full_attention"],
     "layer_types has 'sliding_attention'"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}, "rope_type='yarn'"),
])
def test_qwen3_fields_not_computed_are_refused(qwen3_dirs, tmp_path, capsys, field, value, words):
    """Config fields the model does not compute: one line naming the field, from the builder (before any
    group) and from ``pmz convert`` / ``pmz inspect`` (exit 1, nothing written)."""
    import json
    import shutil

    from models.common.config import UnsupportedConfigError
    from models.qwen3 import build_parallel_model

    src = tmp_path / "src"
    shutil.copytree(qwen3_dirs[0]["qwen3_untied"], src)
    data = json.loads((src / "config.json").read_text())
    data[field] = value
    (src / "config.json").write_text(json.dumps(data))
    with pytest.raises(UnsupportedConfigError, match=re.escape(words)):
        build_parallel_model(src)
    for args in (["convert", src, tmp_path / "out", "--to", "vllm"], ["inspect", src]):
        rc, lines = _pmz(capsys, *args)
        assert rc == 1 and len(lines) == 1 and words in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_pmz_convert_inspect_verify_qwen3(qwen3_dirs, tmp_path, capsys):
    """``pmz convert`` HF -> HF keeps every tensor (``pmz verify --logits``: transformers' logits equal), ``pmz
    inspect`` names the architecture, and a changed k_norm in the copy is caught by verify (logits move)."""
    from safetensors.torch import load_file, save_file

    from converters.cli import main

    for name, arch, extra in (("qwen3_untied", "qwen3", "head_dim 24"), ("qwen3moe_norm", "qwen3_moe", "no shared")):
        src, out = qwen3_dirs[0][name], tmp_path / name
        assert _pmz(capsys, "convert", src, out, "--to", "hf", "--quiet")[0] == 0
        capsys.readouterr()
        assert main(["inspect", str(out)]) == 0
        text = capsys.readouterr().out
        assert re.search(rf"^architecture\s+{arch}$", text, re.M) and extra in text, text
        assert main(["verify", src, str(out), "--logits"]) == 0
        assert "logits (transformers, fixed prompt): max abs diff 0\n" in capsys.readouterr().out
        tensors = load_file(str(out / "model.safetensors"))
        key = "model.layers.0.self_attn.k_norm.weight"
        tensors[key] = tensors[key] * 1.5
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        assert main(["verify", src, str(out), "--logits"]) == 1
        report = capsys.readouterr().out
        assert key in report and "max abs diff 0\n" not in report.split("logits (transformers")[1], report


def test_qwen3_with_o_proj_bias_refused_for_vllm(qwen3_dirs, tmp_path, capsys):
    """vLLM 0.32's Qwen3 has no o_proj bias (transformers' attention_bias adds one): its format is refused in
    one line by ``pmz convert --to vllm`` and by the live writers, before anything is written."""
    from models.common.export import ExportError
    from models.qwen3 import build_parallel_model

    src = qwen3_dirs[0]["qwen3_tied_kv1"]  # attention_bias=True
    rc, lines = _pmz(capsys, "convert", src, tmp_path / "out", "--to", "vllm")
    assert rc == 1 and len(lines) == 1 and "attention_bias=True" in lines[0], lines
    model = build_parallel_model(src)  # one process: a collective would fail differently
    with pytest.raises(ExportError, match="attention_bias=True"):
        model.save_vllm_sharded_state(tmp_path / "live", tp=1)
    with pytest.raises(ExportError, match="attention_bias=True"):
        next(iter(model.iter_export("vllm", target_tp=1, target_rank=0)))
    assert sorted(p.name for p in tmp_path.iterdir()) == []
